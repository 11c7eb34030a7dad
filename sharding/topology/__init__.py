"""The hardware: a cluster's hosts, GPUs, links, memory and network (``cluster``), read from YAML or
imported from ``nvidia-smi topo -m`` (``nvidia_smi``, ``topo_matrix``, ``gpu_presets``), and the
rank-pair paths and bandwidths derived from it (``links``, ``bandwidth``).

Submodules are imported by their full names; importing this package imports nothing else.
"""
