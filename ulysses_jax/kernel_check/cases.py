"""The attentions a model's layers take (``AttentionKind``, the case list), and for each on a
mesh the backends to try (``choose_backend``'s chain) and the problem its check runs (``Case``).

An attention kind is data: ``attention_kinds(model_config)`` lists the distinct kinds of the
model's layers, each with the keyword arguments it adds to the attention call
(``sliding_window``). Every kind is checked on its own path, as the run executes it; a new kind
(attention sinks, say) is one more field of ``AttentionKind``, its entry in
``attention_kinds``, and its input in the check's problem.

The problem a case checks keeps the run's path while staying small:

* no ring: the whole sequence runs through the local attention after the all-to-all, on
  ``CHECK_LEN`` tokens, or ``WINDOW_CHECK_LEN`` with a window: W as it is up to half of that,
  else ``WINDOW_STAND_IN`` (no multiple of any kernel block, hiding whole key blocks from the
  later query blocks, so the kernels' block skipping and their mask at the window's edge run);
* on a ring: ``RING_CHECK_LEN`` tokens per ring device (a few kernel blocks). Whether a window
  runs in the kernels inside the ring depends on the run's S/R (``ring.window_in_two_steps``:
  W <= S/R, natural layout), known here from the run's ``seq_len`` and mesh, and the check's
  window keeps that side of S/R: W or a stand-in of ``ring_window_stand_in`` tokens when it
  fits one ring device's tokens, else W or that stand-in plus one device's tokens.
"""

import dataclasses

from jax.sharding import Mesh

from ulysses_jax.attention import backends, ring, zigzag
from ulysses_jax.kernel_check.compare import CHECK_LEN, Problem
from ulysses_jax.mesh import SEQ, ring_size

WINDOW_CHECK_LEN = 1024  # tokens of a windowed check without a ring: 8 blocks of 128
WINDOW_STAND_IN = 200  # the window checked for W > WINDOW_CHECK_LEN / 2
RING_CHECK_LEN = 512  # tokens per ring device of a check on a ring: 4 blocks of 128


def ring_window_stand_in(tokens_per_device: int) -> int:
  """The window checked in a ring for a W too long for the check (200 of 512 tokens)."""
  return max(2, tokens_per_device * 25 // 64)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """One kind of attention a layer takes: full (``window`` None) or a sliding window."""
  window: int | None = None

  @property
  def name(self) -> str:
    return "full attention" if self.window is None else f"sliding window {self.window}"


def attention_kinds(model_config) -> tuple[AttentionKind, ...]:
  """The distinct kinds of a ``LlamaConfig``'s layers, in the order of the layers."""
  return tuple(dict.fromkeys(AttentionKind(w) for w in model_config.layer_windows()))


def tokens_per_ring_device(seq_len: int, mesh: Mesh) -> int:
  """S/R of a run of ``seq_len`` tokens on ``mesh`` (padded as ``ulysses_attention`` pads)."""
  r = ring_size(mesh)
  return zigzag.padded_length(seq_len, r, mesh.shape[SEQ]) // r


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention kind on the run's mesh: ``choice``, the backend first tried (``"auto"``'s
  pick, or the one set) and its fallbacks; ``problem``, what the check runs."""
  kind: AttentionKind
  choice: backends.BackendChoice
  problem: Problem

  @property
  def chain(self) -> tuple[str, ...]:
    return (self.choice.backend, *self.choice.fallbacks)

  @property
  def name(self) -> str:
    return self.kind.name

  @property
  def label(self) -> str:
    """``name`` and, for a window or a ring, the problem checked."""
    p, details = self.problem, []
    if p.window is not None and p.window != self.kind.window:
      details.append(f"with window {p.window}")
    if p.on_ring:
      details.append(f"on a ring of {ring_size(p.mesh)} x {p.seq_len // ring_size(p.mesh):,} "
                     "tokens")
    elif p.window is not None:
      details.append(f"on {p.seq_len:,} tokens")
    return f"{self.name} (checked {' '.join(details)})" if details else self.name


def make_case(kind: AttentionKind, shapes: dict, mesh: Mesh, attention_backend: str,
              seq_len: int) -> Case:
  """The ``Case`` of ``kind`` in a run of ``seq_len`` tokens on ``mesh``; ``shapes``:
  ``choose_backend``'s other inputs. Raises ``ValueError`` for a set backend the run could not
  use here (a ring's, ``ring.resolve_backend``)."""
  window, on_ring = kind.window, ring_size(mesh) > 1
  run_len = tokens_per_ring_device(seq_len, mesh) if on_ring else None
  in_two_steps = ring.window_in_two_steps(window, "natural", run_len)
  choice = backends.choose_backend(**shapes, mesh=mesh, sliding_window=window,
                                   ring_window_in_two_steps=in_two_steps)
  if attention_backend != "auto":
    if on_ring:  # the error the model would raise, before any check runs
      ring.resolve_backend(attention_backend, **shapes, mesh=mesh, sliding_window=window,
                           layout="natural", local_len=run_len)
    chain = tuple(dict.fromkeys((attention_backend, choice.backend, *choice.fallbacks, "xla")))
    chain = chain[:chain.index("xla") + 1]
    choice = backends.BackendChoice(chain[0], f"{chain[0]}: set by LlamaConfig.attention_backend "
                                    f"(auto would pick {choice.reason})", chain[1:])
  problem = dict(dtype=shapes["dtype"], head_dim=shapes["head_dim"],
                 num_q_heads=shapes["num_q_heads"], num_kv_heads=shapes["num_kv_heads"],
                 causal=shapes["causal"], segment_ids_given=shapes["segment_ids_given"],
                 sinks_given=shapes.get("sinks_given", False), mesh=mesh)
  if on_ring:
    per_device = RING_CHECK_LEN
    check_len, stand_in = ring_size(mesh) * per_device, ring_window_stand_in(per_device)
    if window is None:
      check_window = None
    elif in_two_steps:  # the kernels' windowed ring: W <= S/R in the check too
      check_window = window if window <= per_device // 2 else stand_in
    else:  # the window reaches past the previous ring device: so in the check
      check_window = window if per_device < window < check_len else per_device + stand_in
  elif window is None:
    check_len, check_window = CHECK_LEN, None
  else:
    check_len = WINDOW_CHECK_LEN
    check_window = window if window <= WINDOW_CHECK_LEN // 2 else WINDOW_STAND_IN
  return Case(kind, choice, Problem(**problem, seq_len=check_len, window=check_window))
