"""What the locks do, made visible: events, metrics, the skip log, masking."""
