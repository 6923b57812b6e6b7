"""Moving weights to where the plan puts them, undoing that on failure, and putting them
back on restore. Shared by every executor; each move is the one `OffloadPlan.move_of`
names for the weight's live device, so no executor decides how a weight travels.

- `find`: the plan matched to the live layers (`find_moves`), ties and view groups.
- `marks`: the mark on wrapped layers (a second wrap, deepcopy and pickle refused).
- `move`: the host copies made and parameters pointed at them, undone on failure.
- `restore`: weights given back one storage at a time; replacements taken first.
- `progress`: the progress log of a long move.

Memory. Weights move one tensor at a time and nothing keeps a second copy of the model:
a pageable host tensor that is offloaded unpinned is adopted as its own host copy; one
that is pinned is copied into page-locked memory and released as soon as the parameter
points at the copy (undo copies it back from there); restore gives each storage back
and releases its host copy before the next. So host memory peaks at the model's bytes
plus its largest tensor (its largest layer, where the prefetch backend puts a layer's
copies in one block: `offload.pure.plan.blocks`), and device memory at the resident weights
(plus buffers) plus the largest tensor, wherever the weights came from.

Import from the modules themselves; this package re-exports nothing.
"""
