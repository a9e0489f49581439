"""What a duplicate gets: skip, retry, raise, replace; scopes, limits, throttles, redeliveries."""
