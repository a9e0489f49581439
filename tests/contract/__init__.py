"""The cross-deployment contract: the core promises written once (promises.py), run on each kind of
lock server."""
