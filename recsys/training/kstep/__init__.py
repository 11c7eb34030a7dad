"""Hierarchical training: replicas on different hosts train on their own and merge every k steps
(docs/kstep.md).

- `host_groups.py`: the host and replica process groups (host-major ranks), the plan moved onto
  one host's ranks, the collective timeout that stops a job whose host is lost;
- `merger.py`: `KStepMerger`, the merge of dense parameters and embedding shards (flat or
  hierarchical route);
- `merge_hook.py`: `KStepMergeHook`, its two-line form for an existing TorchRec loop;
- `touched_rows.py`: which embedding rows moved since the last merge, so only those are sent;
- `outer.py`: the merge's outer step (DiLoCo's Nesterov) and bf16 deltas with error feedback.
"""
