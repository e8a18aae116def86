//! `TransformerModel`, checkpoint loading and sampling.
