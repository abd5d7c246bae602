"""ping-pack trainer: a thin Grain reader over packed shards and a JAX decoder-only transformer."""
