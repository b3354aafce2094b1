"""`jetshard up --lan`: the machines of a network find each other and their embedded nats-servers form one
cluster over NATS routes.

Why it is shaped so:
- Each machine's services connect to their own server on loopback; the network sees only the route port,
  which admits only servers that know the cluster's secret (the join token carries it).
- A clustered JetStream elects its meta leader only among two or more JetStream servers (nats-server expects
  two at a first start and, alone, waits for routes forever). So the first machine runs a small second server
  beside its own, the *witness*: a JetStream peer that holds none of jetshard's streams (those are placed on
  servers tagged `DATA_TAG`). One machine alone works, and so do two: the second may go at any time; without
  the first, which holds the data, JetStream stops, as it must.
- Once three data servers are current in the meta group, the witness leaves it (the first machine would
  otherwise hold two votes of four) and every stream and bucket moves to three replicas: from then on the
  cluster survives the loss of any one machine.
- A joining machine starts its server with JetStream off until its routes reach the cluster's JetStream, so it
  never bootstraps a meta group of its own: two meta groups never merge.

Here: `discovery` (the mDNS announcements), `membership` (the join token, who this machine is, its servers'
layout), `servers` (starting and tending them), `jetstream` (the meta group, the witness's retirement, the join
lock), `options` (the flags of `up --lan`) and `commands` (`jetshard lan ls|forget`).
"""
