//! Test support for services built on pgbox (feature `testing`).
