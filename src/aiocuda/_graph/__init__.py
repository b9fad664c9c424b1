"""The graph layer's private half: the state of a capture in progress (:mod:`.capture`),
which streams, events and memory consult while one of their streams is being captured;
the kernels behind driver functions (:mod:`.kernels`); what node updates are given,
resolved to memory (:mod:`.operands`)."""
