"""A device node: drafts with an ONNX SLM, uploads drafts, corrects in DL mode, reports its timings.

numpy, onnxruntime, pyzmq and pyyaml only: this module must never import torch (directly or through
`testbed`'s heavier modules); `tests/test_live_*.py` checks it in a real device process.

Run: ``python -m device_node.node --connect tcp://HOST:PORT --name dev0 --draft draft.onnx [--hardware phone]``
(or ``multispin device ...``). The edge sends the prompt ids, the seed and the sampling parameters at
registration; the device has no tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import zmq

from device_node.hardware import HardwareProfile, load_hardware
from device_node.options import add_arguments
from testbed.core.sampling import RoundRandomness, SamplingParams, sample_correction
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.device")


class DeviceNode:
    def __init__(self, connect: str, name: str, drafter, hardware: HardwareProfile | None = None, *,
                 register_timeout_s: float = 120.0, idle_timeout_s: float = 300.0, tx_marker: bool = True):
        self.connect, self.name, self.drafter = connect, name, drafter
        self.hardware = hardware or HardwareProfile()
        self.register_timeout_s, self.idle_timeout_s = register_timeout_s, idle_timeout_s
        self.tx_marker = tx_marker
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, name.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(connect)
        self.rounds_done = 0

    # -- transport ------------------------------------------------------------------------------
    def _recv(self, timeout_s: float):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart(copy=False)
        return P.decode(frames)

    def _send_air(self, frames: list, air: str) -> None:
        # A tiny marker first: the channel emulator starts the air time when the marker arrives, so the
        # real transfer time of the large payload is absorbed instead of added (no clocks are compared).
        if self.tx_marker:
            self.sock.send(P.tx_start_marker(air))
        self.sock.send_multipart(frames, copy=False)

    # -- life cycle -----------------------------------------------------------------------------
    def run(self) -> int:
        """Register, then serve schedules until the edge says bye. Returns a process exit code."""
        self.sock.send_multipart(M.register(self.name, self.drafter.vocab_size, self.hardware.to_dict()))
        msg = self._recv(self.register_timeout_s)
        if msg is None:
            log.error("%s: no answer from the edge at %s within %.0f s", self.name, self.connect,
                      self.register_timeout_s)
            return 3
        header, arrays = msg
        if header["type"] == P.ERROR:
            log.error("%s: registration refused: %s", self.name, header.get("message"))
            return 4
        if header["type"] != P.REGISTERED:
            log.error("%s: expected 'registered', got %r", self.name, header["type"])
            return 4
        self._start_session(header, arrays)
        while True:
            msg = self._recv(self.idle_timeout_s)
            if msg is None:
                log.error("%s: no message from the edge for %.0f s; leaving", self.name, self.idle_timeout_s)
                return 5
            header, arrays = msg
            kind = header["type"]
            try:
                if kind == P.SCHEDULE:
                    self._on_schedule(header)
                elif kind == P.VERDICT:
                    self._on_verdict(header, arrays)
                elif kind == P.BYE:
                    log.info("%s: done (%s) after %d rounds", self.name, header.get("reason"), self.rounds_done)
                    return 0
                elif kind == P.ERROR:
                    log.warning("%s: edge reports: %s", self.name, header.get("message"))
                    if header.get("fatal"):
                        return 6
                else:
                    log.warning("%s: ignoring message of type %r", self.name, kind)
            except ProtocolError as exc:
                log.warning("%s: refused a %s message: %s", self.name, kind, exc)

    def close(self) -> None:
        self.sock.close(linger=0)

    def _start_session(self, header: dict, arrays: dict) -> None:
        self.session = header["session"]
        self.seed = int(header["seed"])
        self.params = SamplingParams(**header["sampling"])
        self.bits = int(header["bits_per_prob"])
        self.on_air = header.get("on_air_vocab_size")
        self.max_draft_len = int(header["max_draft_len"])
        self.tx_marker = self.tx_marker and bool(header.get("tx_marker", True))
        prompt = [int(t) for t in arrays["prompt_ids"]]
        if not prompt or max(prompt) >= self.drafter.vocab_size:
            raise ProtocolError(f"registered.prompt_ids: ids must be in [0, {self.drafter.vocab_size})")
        self.committed = list(prompt)  # prompt + every output token, in order
        self.drafter.reset(prompt)
        self.pending = None  # (schedule, tokens, q_rows) of the round in flight
        log.info("%s: session %s, prompt of %d tokens", self.name, self.session, len(prompt))

    # -- one round ------------------------------------------------------------------------------
    def _on_schedule(self, header: dict) -> None:
        sched = M.parse_schedule(header, self.max_draft_len)
        rr = RoundRandomness(self.seed, self.name, sched.round)
        t0 = time.perf_counter()
        # Sampled through the wire precision: q_rows are exactly what the edge rebuilds from the upload.
        tokens, q_rows = self.drafter.draft(sched.draft_len, self.params, rr.draft_generator(),
                                            wire_bits=self.bits)
        q_wire = self.drafter.last_wire
        compute_s = time.perf_counter() - t0
        # Emulated slower hardware: sleep the extra (scale - 1) x the measured compute.
        extra_s = (self.hardware.compute_scale - 1.0) * compute_s
        if extra_s > 0:
            time.sleep(extra_s)
        draft_s = time.perf_counter() - t0
        self.pending = (sched, list(tokens), q_rows)  # float64: never rounded again
        timings = {"draft_s": draft_s, "compute_s": compute_s, "emulated_extra_s": extra_s,
                   "compute_scale": self.hardware.compute_scale}
        frames = M.draft(sched.round, sched.mode, tokens, q_rows, q_wire=q_wire, last_token=self.committed[-1],
                         bits_per_prob=self.bits, on_air_vocab=self.on_air, timings=timings)
        self._send_air(frames, "ul")

    def _on_verdict(self, header: dict, arrays: dict) -> None:
        if self.pending is None or header.get("round") != self.pending[0].round:
            raise ProtocolError(f"verdict.round: {header.get('round')!r} does not match the round in flight "
                                f"{None if self.pending is None else self.pending[0].round}")
        sched, tokens, q_rows = self.pending
        self.pending = None
        v = M.parse_verdict(header, arrays, draft_len=sched.draft_len, vocab_size=self.drafter.vocab_size,
                            bits_per_prob=self.bits, on_air_vocab=self.on_air)
        if v.dropped:
            # The edge dropped this round (deadline missed): forget the drafts, redraft next round.
            log.info("%s: round %d dropped by the edge: %s", self.name, v.round, header.get("reason"))
            self.drafter.reset(self.committed)
            return
        t0 = time.perf_counter()
        if v.token is not None:
            token = v.token  # UL-mode correction/bonus, or the DL-mode bonus, sampled at the edge
        else:
            # DL mode, rejection at j = n_accepted: correct here with our own q_j (the exact row the draft
            # was sampled from, the one the edge would rebuild in UL mode), the p_j the edge verified with
            # (exact_from_wire of the downloaded row) and the round's final draw.
            if sched.mode != "DL" or v.n_accepted >= sched.draft_len:
                raise ProtocolError(f"verdict: a distribution p for n_accepted={v.n_accepted} in mode {sched.mode}")
            rr = RoundRandomness(self.seed, self.name, sched.round)
            token = sample_correction(v.p_row, q_rows[v.n_accepted], rr.final_uniform())
        correction_s = time.perf_counter() - t0
        self.drafter.commit(v.n_accepted, token)
        self.committed.extend(tokens[: v.n_accepted] + [token])
        self.rounds_done += 1
        self.sock.send_multipart(M.report(sched.round, token, v.n_accepted, {"correction_s": correction_s},
                                          v.channel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_node.node", description="A multispin device node.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_from_args(args)


def run_from_args(args) -> int:
    from device_node.drafter import OnnxDrafter  # onnxruntime + numpy only

    try:
        hardware = load_hardware(args.hardware)
    except ValueError as exc:
        print(f"device: error: {exc}", file=sys.stderr)
        return 2
    drafter = OnnxDrafter(args.draft, threads=hardware.threads)
    node = DeviceNode(args.connect, args.name, drafter, hardware, register_timeout_s=args.register_timeout,
                      tx_marker=not args.no_tx_marker)
    try:
        return node.run()
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main())
