//! Support crate for the end-to-end tests.
