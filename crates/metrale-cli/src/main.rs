//! The `metrale` command line.

fn main() {}
