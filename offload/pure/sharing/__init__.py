"""Sharing host copies among processes, the pure part: who shares with whom and where each
copy lies (`plan`), the host memory of a whole job (`admission`), and its text
(`render`). The effects are in `offload.sharing`."""
