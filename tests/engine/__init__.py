"""The engine and every deployment it talks to: one server, Sentinel, Cluster, Redlock, Valkey,
WAIT, TLS."""
