"""Redlock: every lock on a majority of N independent masters."""
