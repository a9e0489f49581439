"""A key means what the user means: arguments, models, migrations."""
