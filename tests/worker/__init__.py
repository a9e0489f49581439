"""The bad day on real workers: kills, outages, freezes, shutdowns."""
