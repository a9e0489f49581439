"""The doctor and the checks at worker start."""
