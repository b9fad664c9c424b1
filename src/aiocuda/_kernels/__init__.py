"""The kernel layer's private half: kernel signatures, argument packing, NVRTC and its
on-disk compile cache."""
