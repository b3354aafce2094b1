"""`jetshard up`: the command (`command`), its NATS (`nats`), the services it runs (`services`) under its
supervisor (`supervisor`), and the model it places once they are up (`placing`)."""
