"""The `jetshard` commands other than `up` and `lan`: the services' own, and the clients of a running cluster
(through its HTTP API, or its NATS for `events` and `state`)."""
