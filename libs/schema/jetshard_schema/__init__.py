"""jetshard's wire contracts: ids, model cards, commands, events, State and `apply`. No I/O."""
