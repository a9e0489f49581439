"""The doctor: checks of the lock Redis, shared by the CLI and the worker's start."""
