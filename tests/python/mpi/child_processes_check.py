"""Processes a rank starts ([Note: processes a rank starts] in csrc/comm/world.cpp): a
spawned DataLoader worker whose worker_init_fn reads the rank, and a subprocess given a
copy of os.environ, see the rank that started them and never start MPI (Open MPI ended
them: "orte_init failed"); a RaNNCModule there is an error saying why."""
import os
import subprocess
import sys
import textwrap

import torch

import rannc

rank, world = rannc.get_rank(), rannc.get_world_size()


def seen_rank(worker_id):
    torch.utils.data.get_worker_info().dataset.seen = (rannc.get_rank(), rannc.get_world_size())


class Ranks(torch.utils.data.Dataset):
    seen = None

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(self.seen)


# a spawned worker imports this file again as __mp_main__ (and reads the rank above)
if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(Ranks(), batch_size=2, num_workers=1,
                                         multiprocessing_context="spawn", worker_init_fn=seen_rank)
    batch = next(iter(loader))
    assert batch.tolist() == [[rank, world]] * 2, batch

    child = """
    import torch, rannc
    print("child sees", rannc.get_rank(), rannc.get_world_size(), rannc.get_local_rank(), flush=True)
    try:
        rannc.RaNNCModule(torch.nn.Linear(2, 1))
    except rannc.CommError as e:
        print("child refused:", e, flush=True)
    """
    env = dict(os.environ)  # a copy: the rank's identity must be in it
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(child)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"child sees {rank} {world} {rank}" in out.stdout, out.stdout + out.stderr
    assert "child refused: this process" in out.stdout and f"was started by rank {rank}" in out.stdout, \
        out.stdout
    rannc.barrier(60)
    print(f"OK rank {rank}", flush=True)
