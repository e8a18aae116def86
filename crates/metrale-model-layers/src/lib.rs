//! Weights, layers, and `ops`: one typed launcher per kernel.
