"""DCP on the tensor stores: `torch.distributed.checkpoint` saves to memory and reshards from memory.

    dcp.save(state_dict, storage_writer=tenplex.dcp.StoreWriter("job", step))
    dcp.load(state_dict, storage_reader=tenplex.dcp.StoreReader("job"))

An adapter between DCP's storage interfaces and the roles `tenplex.save` and `tenplex.load` run on: DCP
says what each rank writes and reads; tenplex's planner picks each read's source (`layout` turns DCP's read
items into the planner's target layout), its executor moves the bytes, its commit makes a save whole. A
snapshot written this way is a tenplex snapshot (same manifest, same blobs, same atomic commit), so
`tenplex.load` reads it too, and `StoreReader` reads what `tenplex.save` wrote. A `checkpoint_id` path
names a job and a step (`location`), so code written for DCP's file system passes its folders through
unchanged.
"""

from ..transformer.errors import CheckpointExistsError
from .location import location
from .reader import StoreReader
from .writer import StoreWriter

__all__ = ["CheckpointExistsError", "StoreReader", "StoreWriter", "location"]
