"""Prints each rank's topology; the test compares it with the expected layout."""
import ringreduce as hvd

hvd.init()
print(f"TOPO {hvd.rank()} {hvd.size()} {hvd.local_rank()} {hvd.local_size()} "
      f"{hvd.cross_rank()} {hvd.cross_size()}", flush=True)
print(f"OK rank {hvd.rank()}", flush=True)
