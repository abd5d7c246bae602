"""ping-pack ETL: measurements -> validated columns -> contexts -> tokens -> packed rows -> shards."""
