"""The sets layer: process sets (Horovod's `ProcessSet`, registered collectively), each
member's `ActiveSet` with its transport and its engine (ordering, the engine thread,
handles), and the job's start-up and shutdown (`world`). May import `core`, `kernels`, `gpu`
and `transport`."""
