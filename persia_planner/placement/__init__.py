"""A placement: its shards (rows, columns, devices), the bytes the runtimes allocate for them, and whether a table's
constraints can be met on a topology."""
