"""Read-back checksums (checksums.py): one digest per pod over vLLM's per-parameter and the
worker's per-buffer digests, a layout per dtype and tensor keys, and the agreement rule."""

from __future__ import annotations

from dataclasses import replace

from refit_operator.core import checksums, podflow
from refit_operator.core.api_status import STATUS_CHECKSUMS_LIMIT, PodProbe, VersionChecksum
from refit_operator.core.checksums import (
    CHECKSUM_MISMATCH,
    Peer,
    Readbacks,
    Witnesses,
    judge,
    read_back,
)

PARAMS = {"dp0:pp0:pcp0:tp0:model.w": "aa", "dp0:pp0:pcp0:tp0:model.v": "bb"}
BUFFERS = {"dp0:pp0:pcp0:tp0:model.rotary.cache": "cc"}


def test_one_digest_over_every_tensor_and_a_layout_per_dtype_and_keys():
    a = read_back("float32", PARAMS, BUFFERS)
    assert a == read_back("float32", dict(reversed(PARAMS.items())), BUFFERS)  # order-free
    assert a.tensors == 3 and len(a.digest) == checksums.DIGEST_HEX
    # A changed parameter or a changed buffer changes the digest, not the layout.
    skewed_param = read_back("float32", {**PARAMS, "dp0:pp0:pcp0:tp0:model.w": "ab"}, BUFFERS)
    skewed_buffer = read_back("float32", PARAMS, {"dp0:pp0:pcp0:tp0:model.rotary.cache": "cd"})
    for other in (skewed_param, skewed_buffer):
        assert other.layout == a.layout and other.digest != a.digest
    # Another dtype, another rank layout, a buffer counted as a parameter: other layouts.
    tp = {k.replace("tp0", "tp1"): v for k, v in PARAMS.items()}
    assert read_back("bfloat16", PARAMS, BUFFERS).layout != a.layout
    assert read_back("float32", {**PARAMS, **tp}, BUFFERS).layout != a.layout
    assert read_back("float32", {**PARAMS, **BUFFERS}, {}).layout != a.layout


def test_the_first_records_later_pods_must_agree():
    own = read_back("float32", PARAMS, BUFFERS)
    assert judge(own, "v1", None, Witnesses.of([])) is None  # the first of its version and layout
    assert judge(own, "v1", None, Witnesses.of([Peer("p0", own.digest, False)])) is None
    refused = judge(own, "v1", None, Witnesses.of([Peer("p0", "f" * 32, False)]))
    assert refused is not None and refused.reason == CHECKSUM_MISMATCH
    assert "p0" in refused.message and own.layout in refused.message and "v1" in refused.message


def test_a_recorded_checksum_wins_over_peers_and_probed_peers_over_unprobed():
    own = read_back("float32", PARAMS, BUFFERS)
    agreeing = Witnesses.of([Peer("p0", own.digest, True)])
    refused = judge(own, "v1", "e" * 32, agreeing)
    assert refused is not None and "recorded" in refused.message
    assert judge(own, "v1", own.digest, Witnesses.of([Peer("p0", "e" * 32, False)])) is None
    # A probed peer outweighs any number of unprobed ones.
    peers = [Peer("p0", own.digest, True), Peer("p1", "e" * 32, False), Peer("p2", "e" * 32, False)]
    assert judge(own, "v1", None, Witnesses.of(peers)) is None
    # Among unprobed peers the majority decides, the earliest on a tie.
    assert judge(own, "v1", None, Witnesses.of([Peer("p1", "e" * 32, False),
        Peer("p2", own.digest, False), Peer("p3", own.digest, False)])) is None  # fmt: skip
    assert judge(own, "v1", None, Witnesses.of([Peer("p1", "e" * 32, False),
        Peer("p2", own.digest, False)])) is not None  # fmt: skip
    # The pod judged is not its own witness.
    alone = Witnesses.of([Peer("me", "e" * 32, False), Peer("p1", own.digest, False)], me="me")
    assert judge(own, "v1", None, alone) is None
    # The message names a few holders and counts the rest.
    many = Witnesses.of([Peer(f"p{i}", "e" * 32, True) for i in range(5)], me="p0")
    refused = judge(own, "v1", None, many)
    assert refused is not None and "p1, p2, p3 and 1 more hold " in refused.message


def _progress(name: str, version: str, layout: str, digest: str, **kw: object) -> podflow.Progress:
    p = podflow.start("wr", "uid-1", version, "/ckpt", 1.0)
    return replace(p, layout=layout, checksum=digest, **kw)  # type: ignore[arg-type]


def _groups(w: Witnesses) -> dict[tuple[str, bool], list[str]]:
    named = {k: [p for p in pods if p != w.me] for k, pods in w.groups.items()}
    return {k: pods for k, pods in named.items() if pods}


def test_readbacks_are_pods_of_the_version_and_layout_that_did_not_disagree():
    readbacks = Readbacks()
    readbacks.reset([
        ("a", _progress("a", "v1", "L", "d1", outcome="Succeeded")),
        ("b", _progress("b", "v1", "L", "d2", outcome="Failed", reason=CHECKSUM_MISMATCH)),
        ("c", _progress("c", "v2", "L", "d3")),  # another version
        ("d", _progress("d", "v1", "M", "d4")),  # another layout
        ("e", _progress("e", "v1", "L", "")),  # not read back yet
        ("f", _progress("f", "v1", "L", "d1", probe=PodProbe(verdict="Pass"))),
        ("g", _progress("g", "v1", "L", "d5")),
        ("h", None),  # no record
    ])  # fmt: skip
    seen = readbacks.witnesses("v1", "L", "g")
    assert _groups(seen) == {("d1", True): ["a", "f"]}  # g, judged, is not its own witness
    assert seen.counts(confirmed=False) == {"d1": 2}
    assert _groups(readbacks.witnesses("v1", "L", "")) == {("d1", True): ["a", "f"],
                                                            ("d5", False): ["g"]}  # fmt: skip
    # A pass moves its pod between groups as it goes; a reset forgets what is not listed.
    readbacks.put("g", _progress("g", "v1", "L", "d5", probe=PodProbe(verdict="Pass")))
    readbacks.put("e", _progress("e", "v1", "L", "d1"))
    readbacks.put("a", _progress("a", "v2", "L", "d3"))
    assert _groups(readbacks.witnesses("v1", "L", "")) == {
        ("d1", True): ["f"], ("d5", True): ["g"], ("d1", False): ["e"]}  # fmt: skip
    assert readbacks.witnesses("v1", "L", "").counts(confirmed=False) == {"d1": 2, "d5": 1}
    assert _groups(readbacks.witnesses("v2", "L", "")) == {("d3", False): ["c", "a"]}
    readbacks.reset([("c", _progress("c", "v2", "L", "d3"))])
    assert _groups(readbacks.witnesses("v1", "L", "")) == {}
    assert _groups(readbacks.witnesses("v2", "L", "")) == {("d3", False): ["c"]}


def test_status_keeps_one_digest_per_version_and_layout_bounded():
    done = [_progress(f"p{i}", "v1", "L", "d1", outcome="Succeeded") for i in range(3)]
    out = checksums.status_checksums([], done, "uid-1")
    assert out == [VersionChecksum(version="v1", layout="L", digest="d1")]
    # Not yet probed, failed, or another refit's: not recorded.
    others = [
        _progress("x", "v2", "L", "d2"),
        _progress("y", "v2", "L", "d2", outcome="Failed"),
        replace(_progress("z", "v2", "L", "d2", outcome="Succeeded"), uid="uid-2"),
    ]
    assert checksums.status_checksums(out, others, "uid-1") == out
    # Kept once written; newest first; never more than the limit.
    many = [_progress("p", f"v{i}", "L", f"d{i}", outcome="Succeeded") for i in range(20)]
    grown = checksums.status_checksums(out, many, "uid-1")
    assert len(grown) == STATUS_CHECKSUMS_LIMIT and grown[0].version == "v19"
    assert checksums.recorded(out, "v1", "L") == "d1" and checksums.recorded(out, "v1", "M") is None
