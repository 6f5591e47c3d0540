"""Can torch.distributed's functional API (what meshkern's compressors call: dist.get_world_size(group),
dist.all_reduce(t, group=group, async_op=True), dist.all_gather) take a torchft ProcessGroup?"""
import sys, os
from datetime import timedelta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ftloop, torch
torch.set_num_threads(1)
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo
from torchft.process_group import ManagedProcessGroup
from torchft._torchft import LighthouseServer
lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
store, port = ftloop.loopback_store(0, True, 1)
w = torch.nn.Parameter(torch.ones(3))
m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=lambda s: None,
            state_dict=lambda: {"w": w}, min_replica_size=1, store_addr="127.0.0.1", store_port=port,
            rank=0, world_size=1, lighthouse_addr=addr, replica_id="r0", hostname="127.0.0.1",
            checkpoint_transport=ftloop.LoopbackHTTPTransport(timedelta(seconds=5)))
if "--with-default-pg" in sys.argv:
    dist.init_process_group("gloo", store=dist.PrefixStore("pp", store), rank=0, world_size=1)
m.start_quorum(); m.wait_quorum()
for name, pg in (("ProcessGroupGloo", m._pg), ("ManagedProcessGroup", ManagedProcessGroup(m))):
    print(name, "pg.size()", pg.size(), "pg.rank()", pg.rank())
    for what, fn in (("dist.get_world_size", lambda: dist.get_world_size(pg)),
                     ("dist.get_rank", lambda: dist.get_rank(pg)),
                     ("dist.all_reduce", lambda: dist.all_reduce(torch.ones(2), group=pg, async_op=True).wait()),
                     ("dist.all_gather", lambda: dist.all_gather([torch.zeros(2)], torch.ones(2), group=pg)),
                     ("pg.allreduce", lambda: pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait())):
        try:
            print(f"  {what}: ok -> {fn()}")
        except Exception as e:
            print(f"  {what}: FAILS: {type(e).__name__}: {str(e)[:150]}")
print("default pg initialized:", dist.is_initialized())
m.shutdown(wait=False); lh.shutdown()
os._exit(0)
