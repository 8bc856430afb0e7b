"""The core layer: what every other layer stands on. Settings (`config`), every public
exception (`errors`), the MPI handle (`mpi`), the timeline, the release (`version`), how every
wait paces itself (`waiting`), which thread is which (`thread_places`), process-wide state
(`state`) and torch.compile's boundary. Imports nothing of ringreduce's but itself."""
