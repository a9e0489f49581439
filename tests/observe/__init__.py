"""What an operator sees: Flower, events, log lines."""
