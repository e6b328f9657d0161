"""The child's side of diagnosis inside grading (see attn_spec.grading.roots for the grader's).

Runs in a submission's process, after its properties ran in the grader: the failures the grader names
are replayed next to the submission with the kit's ordinary adapters and recorder, and the mistake
models fitted to the calls (:func:`attn_spec.diagnosis.run.diagnose`, as ``attn-spec check`` does). The
roots go back as plain JSON. The submission shares this process and can change this code too: the
grader re-checks every root it uses on its own replay and takes none of its words.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from attn_spec.diagnosis.run import diagnose
from attn_spec.grading.isolation import wire
from attn_spec.properties import catalog
from attn_spec.targets.capabilities import supports

TEXT_LIMIT = 200


def answer(chan: wire.Channel, header: dict, targets: dict, hits_fd: list) -> None:
    """Diagnose the failures ``header`` names (ids and minimal cases) on ``targets[header["convention"]]``
    and send the roots. ``hits_fd``: the tripwires' report descriptor (sandbox._HITS), pointed at
    /dev/null meanwhile."""
    quiet = os.open(os.devnull, os.O_WRONLY)  # the kit's own calls to the reference would fill the report pipe
    hits, hits_fd[0] = hits_fd[0], quiet  # (the grader disregards what is reported meanwhile: its replays are checked)
    try:
        target = targets[header["convention"]]
        supports(target, tuple(header["dtypes"]), header["device"])  # as the grader's target was probed: so the
        # replays make the calls they made there, not the probe's
        results = [SimpleNamespace(id=f["id"], status="fail", vacuous=bool(f.get("vacuous")), case=None,
                                   counterexample={"case": f["case"]}) for f in header["failures"]]
        roots = [{"root": d.root, "mistake": d.mistake, "params": d.params, "explains": list(d.explains),
                  "guess": d.guess} for d in diagnose(target, results, catalog())]
        reply = {"roots": roots}
    except BaseException as exc:  # noqa: BLE001 - SystemExit and friends are re-raised
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            raise
        reply = {"roots": [], "error": f"{type(exc).__name__}"[:TEXT_LIMIT]}
    finally:
        hits_fd[0] = hits
        os.close(quiet)
    try:
        chan.send(reply)
    except (wire.ProtocolError, TypeError, ValueError):  # params the JSON header cannot hold
        chan.send({"roots": [], "error": "the roots are not plain data"})
