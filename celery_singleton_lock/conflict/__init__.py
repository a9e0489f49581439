"""What a duplicate gets: the decisions, carried out at send and at run."""
