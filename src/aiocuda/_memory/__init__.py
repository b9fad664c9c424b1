"""The memory layer's private half: every enqueued copy and memset (:mod:`.copies`),
pinned host blocks and their cache, staging of pageable arrays through copier threads,
the off-loop thread for driver calls that wait for an idle device, making the driver see
a pool's frees before a trim (:mod:`.observed_frees`), and the
``__cuda_array_interface__`` / DLPack exchange."""
