"""The request/reply service between process groups (MPMD): the trainer's first process asks,
the group asked answers, every process of the job takes part in every crossing.

Where the placement gives a role processes of its own (the generator: `separate` on whole
hosts; the scorers: `placement.scorers_apart`), the trainer's processes and that group's run
different programs and meet only where the trainer asks. The trainer's first process posts
numbered requests in the coordination service's key-value store (`Link`: one session's, one
numbering for every group); each names its target ("replica": a generator replica's index, or
"scorers"). Every process of the job handles request n after n - 1 (`GroupHost`): the target
group serves it, every other process takes part in its crossings with nothing to send or keep.
JAX matches the two ends of a crossing between disjoint processes by the order in which each
process makes them (sharding/crossing.py), so every process must count every crossing alike.
The target's first process posts the reply of a request that has one (`REPLIED`); the trainer
ends a session with "end", and the groups then wait for the next one, or for `release_groups`.
"""
from __future__ import annotations

import logging

import jax

from jaxrl.config import ConfigError
from sharding import crossing
from sharding.distributed import explained_by_a_lost_peer, from_the_runtime, job, kv_client

log = logging.getLogger("jaxrl")
EXIT_KEY = "jaxrl/sampler/exit"  # set by the trainer's first process when it is done
REPLIED = ("batch", "pause", "score", "critic_update", "critic_home")  # the requests with a reply


class Link:
  """One session's requests and replies (to every group apart: one numbering, so that every
  process calls every crossing in the same order), and the meshes its crossings join."""

  def __init__(self, split):
    """The job's next session (sharding/distributed.py `Job`: every group numbers them alike)."""
    self.split, self.n, self.name = split, 0, f"sampler/{job().next_session()}"
    self.requests = crossing.Mailbox(f"{self.name}/request")
    self.replies = crossing.Mailbox(f"{self.name}/reply")
    self.arrivals = crossing.Mailbox(f"{self.name}/arrived")  # (`pulled`)

  def ends(self, target) -> tuple:
    """(the trainer's mesh, the target's) of `target`'s crossings: a generator replica's (the
    trainer's side its mirror of the sampler's mesh), or the scorers' apart."""
    if target == "scorers":
      return self.split.trainer, self.split.scorer
    return self.split.mirror, self.split.replicas[target]

  def post(self, message: dict, arrays: dict | None = None) -> None:
    """Request n to `message["replica"]` (posted by the trainer's first process), `arrays`
    sent with it (from every trainer process)."""
    if arrays is not None:
      message["arrays"] = crossing.send(arrays, self.ends(message["replica"])[1])
    if jax.process_index() == 0:
      self.requests.post(self.n, message)
    self.n += 1

  def reply(self, failed: type[Exception], who: str, **take) -> dict:
    """The reply to the last request (its target's first process posts it; `take`: the
    mailbox's options). A failure there is raised here as `failed`, "`who` failed: ...", from
    a ConfigError where it was the user's (such as an environment's, which stays one)."""
    reply = self.replies.take(self.n - 1, **take)
    if "error" in reply:
      cause = ConfigError(reply["error"]) if reply.get("config") else None
      raise failed(f"{who} failed: {reply['error']}") from cause
    return reply

  def end(self) -> None:
    """The session's last request: every group waits for the next session."""
    self.post({"op": "end", "replica": None})

  def pulled(self, ok: bool) -> bool:
    """Whether every trainer process pulled the last reply's arrays in full (each says `ok`)."""
    me, n = jax.process_index(), self.n - 1
    self.arrivals.post(f"{n}/{me}", {"ok": ok})
    return all(self.arrivals.take(f"{n}/{p}")["ok"] for p in sorted(self.split.trainer_processes))


def release_groups() -> None:
  """The trainer is done: the processes of the groups apart leave their loop (the trainer's
  first process says it; a no-op elsewhere)."""
  if jax.process_index() == 0 and kv_client() is not None:
    kv_client().key_value_set(EXIT_KEY, "1", allow_overwrite=True)


class GroupHost:
  """A group apart's loop: sessions the trainer starts until it is done, in each the requests
  to `target` served by `serve_request` (a subclass's), every other one's crossings taken
  part in."""

  target = None  # the "replica" of the requests this group serves
  name = "group"  # what the log calls it

  def __init__(self, split, group: frozenset[int]):
    """`group`: this group's processes (the first posts the replies)."""
    self.split, self.link, self.failed = split, None, None
    self.leader = jax.process_index() == min(group)

  def serve(self) -> int:
    """Sessions until the trainer says it is done; the exit code."""
    while (link := self._next_session()) is not None:
      self.link = link
      self._session(link)
    return 0

  def _next_session(self) -> Link | None:
    """The trainer's next session (None: the trainer is done)."""
    link = Link(self.split)
    while True:
      try:
        link.requests.take(0, poll_s=2.0, timeout_s=2.0)
        return link
      except TimeoutError:
        try:
          kv_client().key_value_try_get(EXIT_KEY)
          return None
        except Exception:  # noqa: BLE001 - not set: the trainer is still at work
          continue

  def _session(self, link: Link) -> None:
    """Request after request until "end"."""
    while True:
      request = link.requests.take(link.n)
      if request["op"] == "end":
        link.n += 1
        return
      if request["replica"] == self.target:
        self.serve_request(request)
      else:
        self._bystander(request)
      link.n += 1

  def serve_request(self, request: dict) -> None:
    """One of this group's requests, by its op's handler (`_op`); a failure answers the next
    request that has a reply (the trainer raises it), and every one after it until the next
    "start"."""
    op = request["op"]
    if op == "start":
      self.failed = None
    try:
      reply = (self.failed if self.failed and op != "close" else
               getattr(self, "_" + op)(request))
    except Exception as e:  # noqa: BLE001 - the trainer raises it, named
      if from_the_runtime(e):  # (a dead peer's collective: the peer watch's line, and exit)
        explained_by_a_lost_peer()
      log.exception("%s: %s failed", self.name, op)
      user = next((c for c in (e, e.__cause__) if isinstance(c, ConfigError)), None)
      reply = self.failed = ({"error": str(user), "config": True} if user is not None else
                             {"error": f"{op}: {type(e).__name__}: {e}"})
    if self.leader and op in REPLIED:
      self.link.replies.post(self.link.n, reply)

  def arrived(self, request: dict) -> dict:
    """This group's arrays of `request`, here."""
    home, there = self.link.ends(self.target)
    return crossing.receive(request["arrays"], home, there)

  def _bystander(self, request: dict) -> None:
    """Another group's request: this process calls its crossings too (with nothing to send or
    keep), so that every process counts every crossing alike."""
    home, there = self.link.ends(request["replica"])
    if "arrays" in request:
      crossing.receive(request["arrays"], home, there)
    if request["op"] in REPLIED:
      reply = self.link.replies.take(self.link.n)
      if "arrays" in reply:
        crossing.receive(reply["arrays"], there, home)
