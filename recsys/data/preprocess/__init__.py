"""Raw Criteo / Avazu files to memory-mapped shards (docs/data.md), in stages:
`read_blocks.py` (byte blocks cut at line ends) -> `parse_criteo.py` / `parse_avazu.py` (numpy
block parsers; `bad_rows.py` counts and reports the rows they refuse) -> `recsys/data/shard_writer.py`,
joined by `pipeline.py` (threads, the progress line). `raw_formats.py` drives a whole file set,
`fanout.py` splits the work over tasks (a Slurm array) and joins their parts into one manifest.
"""
