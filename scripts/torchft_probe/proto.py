"""torchft 0.2.0 elasticity probe: a lighthouse on 127.0.0.1, N replicas of S processes
(pipeline stages), per-step gradient allreduce (--mode ddp) or a DiLoCo outer step every
H inner steps (--mode diloco) through the torchft Manager; the driver SIGKILLs one replica
mid-run, restarts it, and measures kill->quorum, heal seconds/bytes, and bit-equality.

    venv/bin/python proto.py                       # 3 replicas x 1 process, ddp
    venv/bin/python proto.py --stages 2            # 3 replicas x 2 stages, one Manager per replica
    venv/bin/python proto.py --stages 2 --per-stage-managers   # one Manager per stage (design B)
    venv/bin/python proto.py --mode diloco --H 4

Every process runs with torch.set_num_threads(1).
"""
import argparse
import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


def emit(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- worker
def worker(a):
    import torch
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    import torch.nn as nn
    sys.path.insert(0, HERE)
    import ftloop
    from torchft import Manager, ProcessGroupGloo

    rid, stage, S = a.replica, a.stage, a.stages
    t_start = time.time()
    # --- the replica's own store (stage 0 hosts it) and its pipeline group
    if stage == 0:
        store, port = ftloop.loopback_store(0, True, S)
        emit(ev="store", r=rid, s=stage, port=port)
    else:
        port = a.store_port
        store = ftloop.loopback_store(port, False, S)
    if S > 1:
        dist.init_process_group("gloo", store=dist.PrefixStore("pp", store), rank=stage,
                                world_size=S, timeout=timedelta(seconds=10))

    # --- the model: S=1 -> Linear,Tanh,Linear in one process; S=2 -> stage 0 / stage 1
    D, B = a.dim, a.batch
    torch.manual_seed(1000 + 17 * rid + 101 * a.incarnation + stage)  # different on purpose
    layers = [nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, D)]
    model = nn.Sequential(*layers) if S == 1 else layers[stage]
    params = list(model.parameters())
    wtrue = torch.randn(D, D, generator=torch.Generator().manual_seed(7)) / D ** 0.5

    # --- torchft: one Manager per replica (group rank = stage) or one per stage (design B)
    if a.per_stage_managers:
        mstore, mport = ftloop.loopback_store(0, True, 1)
        m_rank, m_world, m_rid, m_port = 0, 1, f"r{rid}s{stage}", mport
    else:
        m_rank, m_world, m_rid, m_port = stage, S, f"r{rid}", port
    transport = ftloop.LoopbackHTTPTransport(timeout=timedelta(seconds=a.timeout))

    if a.mode == "ddp":
        opt = torch.optim.AdamW(params, lr=1e-3)

        def state_dict():
            return {"model": model.state_dict(), "opt": opt.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["opt"])
    else:
        inner = torch.optim.AdamW(params, lr=1e-3)
        glob = [p.detach().clone() for p in params]
        outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)

        def state_dict():
            return {"global": glob, "outer": outer.state_dict()}

        def load_state_dict(sd):
            with torch.no_grad():
                for g, v in zip(glob, sd["global"]):
                    g.copy_(v)
            outer.load_state_dict(sd["outer"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout)),
        load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=a.min_replicas,
        use_async_quorum=not a.sync_quorum,
        timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=a.timeout),
        rank=m_rank, world_size=m_world,
        store_addr=ftloop.LOOPBACK, store_port=m_port,
        lighthouse_addr=a.lighthouse, replica_id=m_rid,
        hostname=ftloop.LOOPBACK,
        heartbeat_interval=timedelta(milliseconds=a.hb_interval_ms),
        checkpoint_transport=transport,
        init_sync=True,
    )
    rec = ftloop.QuorumRecorder(manager._client)
    manager._client = rec
    emit(ev="ready", r=rid, s=stage, inc=a.incarnation, pid=os.getpid(),
         setup_s=round(time.time() - t_start, 3), listen=ftloop.listening_sockets(os.getpid()))
    sys.stdin.readline()  # driver's "go" (event-driven start barrier)

    def digest(ts):
        h = hashlib.sha1()
        for t in ts:
            h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:12]

    def opt_digest(o):
        ts = []
        for st in o.state.values():
            ts += [v for k, v in sorted(st.items()) if torch.is_tensor(v)]
        return digest(ts)

    def stop_step():
        try:
            with open(a.stop_file) as f:
                return int(f.read().strip() or 1 << 30)
        except (OSError, ValueError):
            return 1 << 30

    def fwd_bwd(it):
        g = torch.Generator().manual_seed(10_000 * rid + it)
        x = torch.randn(B, D, generator=g)
        y = torch.tanh(x @ wtrue) @ wtrue
        if S == 1:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss.item()
        if stage == 0:
            h = model(x)
            dist.send(h.detach(), 1)
            gh = torch.empty_like(h)
            dist.recv(gh, 1)
            h.backward(gh)
            return float("nan")
        h = torch.empty(B, D)
        dist.recv(h, 0)
        h.requires_grad_()
        loss = nn.functional.mse_loss(model(h), y)
        loss.backward()
        dist.send(h.grad, 0)
        return loss.item()

    def flat_allreduce(vecs):
        flat = torch.cat([v.reshape(-1) for v in vecs])
        t0 = time.perf_counter()
        manager.allreduce(flat).wait()
        dt = time.perf_counter() - t0
        out, o = [], 0
        for v in vecs:
            out.append(flat[o:o + v.numel()].view_as(v))
            o += v.numel()
        return out, dt

    it = 0
    while True:
        t_it = time.perf_counter()
        if manager.current_step() >= stop_step():
            break
        if a.mode == "ddp":
            manager.start_quorum()
            loss = fwd_bwd(it)
            t_q = time.perf_counter()
            manager.wait_quorum()
            q_wait = time.perf_counter() - t_q
            grads, ar_s = flat_allreduce([p.grad for p in params])
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            healing = manager._healing
            t_c = time.perf_counter()
            ok = manager.should_commit()
            sc_s = time.perf_counter() - t_c
            if ok:
                opt.step()
            opt.zero_grad()
            odig = opt_digest(opt)
            dig = digest(params)
        else:
            for _ in range(a.H):
                loss = fwd_bwd(it)
                inner.step()
                inner.zero_grad()
                it += 1
                if a.step_ms:
                    time.sleep(a.step_ms / 1000)
            it -= 1
            manager.start_quorum()
            t_q = time.perf_counter()
            manager.wait_quorum()
            q_wait = time.perf_counter() - t_q
            with torch.no_grad():
                pg = [g - p.detach() for g, p in zip(glob, params)]
            pg, ar_s = flat_allreduce(pg)
            healing = manager._healing
            t_c = time.perf_counter()
            ok = manager.should_commit()  # a healing replica loads glob/outer here
            sc_s = time.perf_counter() - t_c
            if ok:
                for g, d in zip(glob, pg):
                    g.grad = d.clone()
                outer.step()
                outer.zero_grad()
            with torch.no_grad():
                for p, g in zip(params, glob):
                    p.copy_(g)
            odig = opt_digest(outer)
            dig = digest(glob)
        q = rec.last
        ev = dict(ev="step", r=rid, s=stage, inc=a.incarnation, it=it, step=manager.current_step(),
                  t=time.time(), commit=ok, qid=q.quorum_id if q else None,
                  q_wall=rec.last_wall, q_rpc_s=round(rec.last_s, 4), q_wait_s=round(q_wait, 4),
                  ids=sorted(x.split(":")[0] for x in q.replica_ids) if q else [],
                  nparts=manager.num_participants(), rrank=q.replica_rank if q else None,
                  heal=bool(q.heal) if q else False, healing=healing,
                  ar_s=round(ar_s, 4), sc_s=round(sc_s, 4), loss=round(loss, 6),
                  dig=dig, odig=odig, sent=transport.sent,
                  errored=str(manager.errored())[:200] if manager.errored() else None)
        if transport.recv_log:
            ev.update(transport.recv_log.pop(0))
        if it == 2:  # after the first quorum: the torchft Gloo PG exists now
            ev["listen"] = ftloop.listening_sockets(os.getpid())
            ev["pg_rank/parent_rank/size/participating_rank"] = [
                manager._pg.rank(), manager._pg.parent.rank(), manager._pg.size(), manager.participating_rank()]
        ev["iter_s"] = round(time.perf_counter() - t_it, 4)
        emit(**ev)
        it += 1
        if a.mode == "ddp" and a.step_ms:
            time.sleep(a.step_ms / 1000)  # stands in for compute
    emit(ev="exit", r=rid, s=stage, inc=a.incarnation, step=manager.current_step())
    manager.shutdown(wait=False)
    os._exit(0)


# ----------------------------------------------------------------------------- driver
class Driver:
    def __init__(self, a):
        self.a = a
        self.sel = selectors.DefaultSelector()
        self.procs = {}  # (r, s, inc) -> Popen
        self.buf = {}
        self.log = open(a.events, "w")
        self.t0 = time.time()

    def spawn(self, r, s, inc, store_port=0):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--replica", str(r),
               "--stage", str(s), "--incarnation", str(inc), "--store-port", str(store_port),
               "--lighthouse", self.lh_addrs[s if self.a.per_stage_lighthouses else 0]] + self.passthrough
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=open(os.path.join(self.a.outdir, f"r{r}s{s}i{inc}.err"), "w"),
                             env=env, bufsize=0)
        self.procs[(r, s, inc)] = p
        self.buf[p.stdout.fileno()] = b""
        self.sel.register(p.stdout, selectors.EVENT_READ, (r, s, inc))
        return p

    def events(self, timeout):
        """Yield parsed JSON events until timeout (seconds) passes without one... or forever."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for key, _ in self.sel.select(timeout=max(0.0, deadline - time.time())):
                fd = key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.sel.unregister(key.fileobj)
                    yield {"ev": "eof", "who": key.data, "t": time.time()}
                    continue
                self.buf[fd] += chunk
                while b"\n" in self.buf[fd]:
                    line, self.buf[fd] = self.buf[fd].split(b"\n", 1)
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    e["who"] = key.data
                    self.log.write(json.dumps(e) + "\n")
                    yield e
        raise TimeoutError("no progress")

    def start_replica(self, r, inc):
        self.spawn(r, 0, inc)
        ready = 0
        for e in self.events(60):
            if e["ev"] == "store" and e["who"] == (r, 0, inc):
                for s in range(1, self.a.stages):
                    self.spawn(r, s, inc, e["port"])
            if e["ev"] == "ready" and e["who"][0] == r and e["who"][2] == inc:
                ready += 1
                self.ready.append(e)
                if ready == self.a.stages:
                    break
            self.pending.append(e)

    def go(self, r, inc):
        for s in range(self.a.stages):
            p = self.procs[(r, s, inc)]
            p.stdin.write(b"go\n")
            p.stdin.flush()

    def run(self):
        a = self.a
        sys.path.insert(0, HERE)
        from torchft._torchft import LighthouseServer
        if os.path.exists(a.stop_file):
            os.remove(a.stop_file)
        # one lighthouse, or one per stage: a lighthouse has no job/group namespace, so
        # per-stage managers on one lighthouse all land in ONE quorum (see REPORT.md)
        lhs = [LighthouseServer(bind="127.0.0.1:0", min_replicas=a.min_replicas,
                                join_timeout_ms=a.join_ms, quorum_tick_ms=a.tick_ms,
                                heartbeat_timeout_ms=a.hb_timeout_ms)
               for _ in range(a.stages if a.per_stage_lighthouses else 1)]
        # lh.address() names the hostname, not the bound address
        self.lh_addrs = [f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}" for lh in lhs]
        import ftloop
        lh_listen = ftloop.listening_sockets(os.getpid())
        self.passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                            if k in ("mode", "stages", "dim", "batch", "H", "timeout", "quorum_timeout",
                                     "min_replicas", "hb_interval_ms", "step_ms", "stop_file")]
        if a.per_stage_managers:
            self.passthrough.append("--per-stage-managers")
        if a.sync_quorum:
            self.passthrough.append("--sync-quorum")
        if not a.hard_exit:
            self.passthrough.append("--no-hard-exit")
        self.pending, self.ready = [], []
        t_launch = time.time()
        for r in range(a.replicas):
            self.start_replica(r, 0)
        for r in range(a.replicas):
            self.go(r, 0)
        victim = a.replicas - 1
        steps = {}        # (r, s, inc) -> list of step events
        phase, t_kill, t_q2, t_restart, kill_step = "warm", None, None, None, None
        heal_ev, rejoin_ev, stop_at, result, eofs = None, None, None, {}, set()
        gen = self.events(a.max_s)
        while True:
            e = self.pending.pop(0) if self.pending else next(gen)
            if e["ev"] == "step":
                steps.setdefault(tuple(e["who"]), []).append(e)
            who = tuple(e["who"])
            if phase == "warm" and e["ev"] == "step" and who[0] == victim and e["step"] >= a.kill_at:
                if a.kill_delay_ms:
                    time.sleep(a.kill_delay_ms / 1000)  # land the kill inside the victim's next step
                for s in a.kill_stages or range(a.stages):
                    os.kill(self.procs[(victim, s, 0)].pid, signal.SIGKILL)
                t_kill, kill_step, phase = time.time(), e["step"], "killed"
                result["killed_stages"] = list(a.kill_stages or range(a.stages))
                if a.restart_on_kill:
                    t_restart = time.time()
                    for s in range(a.stages):  # a replica restarts as a whole
                        p = self.procs[(victim, s, 0)]
                        if p.poll() is None:
                            os.kill(p.pid, signal.SIGKILL)
                    self.start_replica(victim, 1)
                    self.go(victim, 1)
                    result["restart_ready_s"] = round(time.time() - t_restart, 3)
                    phase = "shrunk"
            elif phase == "killed" and e["ev"] == "step" and who[0] != victim \
                    and e["q_wall"] > t_kill and f"r{victim}" not in " ".join(e["ids"]):
                t_q2, phase = e["q_wall"], "shrunk"
                result["kill_to_quorum_s"] = round(t_q2 - t_kill, 3)
                result["shrunk_quorum"] = {k: e[k] for k in ("qid", "ids", "nparts", "step")}
                if a.restart:
                    t_restart = time.time()
                    self.start_replica(victim, 1)
                    self.go(victim, 1)
                    result["restart_ready_s"] = round(time.time() - t_restart, 3)
                else:
                    stop_at = e["step"] + a.after
                    self._stop(stop_at)
                    phase = "stopping"
            elif phase == "shrunk" and e["ev"] == "step" and who[0] == victim and who[2] == 1:
                if "heal_s" in e and heal_ev is None:
                    heal_ev = e
                if e["commit"] and rejoin_ev is None:
                    rejoin_ev = e
                if rejoin_ev and e["step"] >= rejoin_ev["step"] + a.after and who[1] == 0:
                    stop_at = e["step"] + 3
                    self._stop(stop_at)
                    phase = "stopping"
            if e["ev"] == "eof":
                eofs.add(tuple(e["who"]))
            if phase == "stopping" and all(k in eofs for k in self.procs if not (k[0] == victim and k[2] == 0)):
                break
        for k, p in self.procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                result.setdefault("still_alive_at_end(killed by driver)", []).append(list(k))
                p.kill()
        for lh in lhs:
            lh.shutdown()
        result.update(self.summarize(steps, victim, t_kill, kill_step, t_restart, heal_ev, rejoin_ev))
        result["launch_to_first_commit_s"] = round(
            min(e["t"] for v in steps.values() for e in v if e["commit"]) - t_launch, 3)
        result["listening"] = {"lighthouse(driver)": lh_listen,
                               **{f"r{e['r']}s{e['s']}i{e['inc']}": e["listen"]
                                  for v in steps.values() for e in v if "listen" in e}}
        result["non_loopback_listeners"] = [x for v in result["listening"].values() for x in v
                                            if not x[0].startswith("127.")]
        result["args"] = {k: v for k, v in vars(a).items()}
        print(json.dumps(result, indent=1))
        with open(os.path.join(a.outdir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)

    def _stop(self, step):
        tmp = self.a.stop_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, self.a.stop_file)

    def summarize(self, steps, victim, t_kill, kill_step, t_restart, heal_ev, rejoin_ev):
        out = {"kill_step": kill_step}
        # bit-equality: at every manager step every live replica logged, same digest per stage
        by = {}
        for k, evs in steps.items():
            for e in evs:
                if e["commit"]:
                    by.setdefault((e["s"], e["step"]), {})[f"r{e['r']}i{e['inc']}"] = (e["dig"], e["odig"])
        mismatch = [(s, st, d) for (s, st), d in sorted(by.items()) if len(set(d.values())) > 1]
        out["steps_checked"] = len(by)
        out["digest_mismatches"] = mismatch[:10]
        out["n_digest_mismatches"] = len(mismatch)
        if t_kill:
            nxt = [e for e in steps.get((0, 0, 0), []) if e["commit"] and e["t"] > t_kill]
            if nxt:
                out["kill_to_r0_next_commit_s"] = round(nxt[0]["t"] - t_kill, 3)
        if rejoin_ev is not None:
            healed = [(s, st) for (s, st), d in by.items() if f"r{victim}i1" in d and len(d) > 1]
            out["healed_steps_compared_with_peers"] = len(healed)
            out["healed_equal_to_peers"] = all(len(set(by[k].values())) == 1 for k in healed)
            out["rejoin"] = {k: rejoin_ev[k] for k in ("step", "qid", "ids", "nparts", "t")}
            out["restart_to_first_commit_s"] = round(rejoin_ev["t"] - t_restart, 3)
            out["kill_to_rejoined_commit_s"] = round(rejoin_ev["t"] - t_kill, 3)
        if heal_ev is not None:
            out["heal"] = {k: heal_ev.get(k) for k in ("heal_s", "heal_bytes", "heal_src_rank",
                                                       "heal_step", "step", "qid", "ids", "sc_s")}
        all_heals = [(f"r{e['r']}s{e['s']}i{e['inc']}", e["step"], round(e["heal_s"], 4), e["heal_bytes"])
                     for v in steps.values() for e in v if "heal_s" in e]
        out["all_heals(who,step,s,bytes)"] = all_heals
        # rate of committed steps of survivor r0 stage 0 in three windows
        ev0 = [e for e in steps.get((0, 0, 0), []) if e["commit"]]
        def rate(t_a, t_b):
            n = [e for e in ev0 if t_a <= e["t"] < t_b]
            return round(len(n) / (t_b - t_a), 2) if t_b > t_a and n else None
        if ev0 and t_kill:
            t_first = ev0[min(3, len(ev0) - 1)]["t"]
            out["r0_steps_per_s_before_kill"] = rate(t_first, t_kill)
            t_re = rejoin_ev["t"] if rejoin_ev else ev0[-1]["t"]
            out["r0_steps_per_s_kill_to_rejoin"] = rate(t_kill, t_re)
            if rejoin_ev:
                out["r0_steps_per_s_after_rejoin"] = rate(t_re, ev0[-1]["t"])
        fails = [(e["step"], e["qid"], e["errored"]) for e in steps.get((0, 0, 0), []) if not e["commit"]]
        out["r0_commit_failures(step,qid,err)"] = fails[:6]
        qs = [(e["step"], e["qid"], e["nparts"], "".join(x[1:] for x in e["ids"]))
              for e in steps.get((0, 0, 0), [])]
        out["r0_quorum_changes(step,qid,nparts,ids)"] = [q for i, q in enumerate(qs) if i == 0 or q[1] != qs[i - 1][1]]
        def med(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] if xs else None
        e0 = steps.get((0, 0, 0), [])
        out["r0_median(q_rpc_s,ar_s,sc_s,iter_s)"] = [med([e[k] for e in e0]) for k in ("q_rpc_s", "ar_s", "sc_s", "iter_s")]
        if self.a.stages > 1:
            # do the stages of one replica see the same quorum at the same iteration?
            inc = {}
            for (r, s, i), evs in steps.items():
                for e in evs:
                    ids = tuple(x.split("s")[0] if x.count("s") else x for x in e["ids"])  # r0s1 -> r0
                    inc.setdefault((r, i, e["it"]), {})[s] = (ids, e["commit"], e["step"], e["nparts"])
            bad = [(k, v) for k, v in sorted(inc.items()) if len(v) > 1 and len(set(v.values())) > 1]
            out["stage_disagreements(replica,inc,iter)->{stage:(ids,commit,step,nparts)}"] = [
                (list(k), {str(s): list(x) for s, x in v.items()}) for k, v in bad[:8]]
            out["n_stage_disagreements"] = len(bad)
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--mode", choices=["ddp", "diloco"], default="ddp")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--per-stage-managers", action="store_true")
    p.add_argument("--per-stage-lighthouses", action="store_true", help="one lighthouse per stage")
    p.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--H", type=int, default=4, help="diloco inner steps per outer step")
    p.add_argument("--timeout", type=float, default=10)
    p.add_argument("--quorum-timeout", type=float, default=60)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--hb-interval-ms", type=int, default=100)
    p.add_argument("--hb-timeout-ms", type=int, default=1000)
    p.add_argument("--join-ms", type=int, default=5000)
    p.add_argument("--tick-ms", type=int, default=50)
    p.add_argument("--step-ms", type=float, default=30, help="sleep per inner step (stands in for compute)")
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--after", type=int, default=10)
    p.add_argument("--no-hard-exit", dest="hard_exit", action="store_false")
    p.add_argument("--kill-delay-ms", type=float, default=0)
    p.add_argument("--kill-stages", type=lambda x: [int(v) for v in x.split(",")], default=None)
    p.add_argument("--restart-on-kill", action="store_true", help="restart at once (no wait for the shrunk quorum)")
    p.add_argument("--no-restart", dest="restart", action="store_false")
    p.add_argument("--max-s", type=float, default=180)
    p.add_argument("--stop-file", default=None)
    p.add_argument("--outdir", default=os.path.join(HERE, "runs", "last"))
    a = p.parse_args()
    a.stop_file = a.stop_file or os.path.join(a.outdir, "STOP")
    if a.worker:
        if a.hard_exit:
            # An uncaught error must end the process at once: a normal interpreter exit joins
            # torchft's quorum thread (blocked up to quorum_timeout) while the Rust
            # ManagerServer keeps heartbeating, so a half-dead replica looks healthy.
            def _hook(t, v, tb):
                sys.__excepthook__(t, v, tb)
                sys.stderr.flush()
                os._exit(1)
            sys.excepthook = _hook
        return worker(a)
    os.makedirs(a.outdir, exist_ok=True)
    a.events = os.path.join(a.outdir, "events.jsonl")
    Driver(a).run()


if __name__ == "__main__":
    main()
