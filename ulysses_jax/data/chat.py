"""Conversations in the model's own chat template, with the loss on the turns that train.

The template is the checkpoint's: ``chat_template.jinja`` beside its ``tokenizer.json`` (as
transformers 5 saves it) or ``chat_template`` in its ``tokenizer_config.json`` (a string, or a
list of named templates whose ``"default"`` is used), or a ``.jinja`` file given as
``DataConfig.chat_template``. It is rendered with jinja2 as transformers'
``apply_chat_template`` renders it (``transformers.utils.chat_template_utils``): a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``tojson`` filter
without HTML escaping, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` block,
the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) as
variables, ``add_generation_prompt=False`` and message keys whose value is None dropped
(jinja2's own ``dict`` and ``namespace``, which transformers replaces by versions that refuse
underscore names against sandbox escapes, render the same for every template transformers
accepts). The rendered text is tokenized whole without added special tokens, so the ids equal
``apply_chat_template(messages)``'s.

Which tokens train (are targets):

* ``roles_to_train == ("assistant",)`` and the template wraps assistant turns in
  ``{% generation %}``: the tokens that overlap a generation block, exactly transformers'
  ``return_assistant_tokens_mask=True`` mask;
* otherwise, turn by turn: the text that each turn of a role in ``roles_to_train`` adds to the
  rendering of the turns before it (for an assistant turn, after the header that
  ``add_generation_prompt=True`` writes). A template whose rendering of the first turns is not
  a prefix of the rendering of more turns cannot be labelled this way: an error says so.

A conversation without a token to train is an error naming it (never a silent zero loss).
ShareGPT records (``conversations`` of ``from``/``value``) map to messages (``SHAREGPT_ROLES``).
"""

import datetime
import json
import os
import re
from collections.abc import Sequence

import numpy as np

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def find_template(tokenizer: str, chat_template: str = "", required: bool = True
                  ) -> tuple[str | None, dict[str, str]]:
  """(template text, special tokens) for ``DataConfig.tokenizer`` and ``chat_template``.
  Without a template: raises ``ValueError``, or with ``required=False`` returns None."""
  directory = os.path.dirname(os.path.abspath(tokenizer)) if tokenizer != "byte" else None
  config = {}
  if directory and os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
      config = json.load(f)
  special = {}
  for name in SPECIAL_TOKEN_NAMES:
    value = config.get(name)
    value = value.get("content") if isinstance(value, dict) else value
    if isinstance(value, str):
      special[name] = value
  if chat_template:
    with open(chat_template, encoding="utf-8") as f:
      return f.read(), special
  jinja_file = directory and os.path.join(directory, "chat_template.jinja")
  if jinja_file and os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read(), special
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: transformers uses "default"
    named = {t.get("name"): t.get("template") for t in template}
    if "default" not in named:
      raise ValueError(f"{directory}/tokenizer_config.json has chat templates {sorted(named)} "
                       "but no 'default'; save the one to use as a .jinja file and set "
                       "DataConfig.chat_template to it")
    template = named["default"]
  if not isinstance(template, str):
    if not required:
      return None, special
    where = (f"{directory} has no chat_template.jinja and its tokenizer_config.json no "
             "chat_template" if directory else "DataConfig.tokenizer='byte' has no template")
    raise ValueError(f"conversations need the model's chat template, but {where}; set "
                     "DataConfig.chat_template to a .jinja file")
  return template, special


def _environment():
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
    import jinja2.ext  # pylint: disable=import-outside-toplevel
    import jinja2.sandbox  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("chat templates need jinja2: pip install jinja2") from e

  class Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records the body's
    character span in the output while a render tracks them."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller):
      text = caller()
      if self.environment.tracking is not None:
        blocks, spans = self.environment.tracking
        start = sum(map(len, blocks))
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  env.tracking = None
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env


class ChatTemplate:
  """A chat template and a tokenizer (``corpus.HFTokenizer`` or ``ByteTokenizer``).

  ``encode([(messages, where), ...])`` -> [(ids, targets), ...]: the token ids and bool target
  flags of each conversation; ``where`` names it in errors.
  """

  def __init__(self, template: str, special_tokens: dict[str, str], tokenizer,
               roles_to_train: Sequence[str] = ("assistant",)):
    self._env = _environment()
    self._template = self._env.from_string(template)
    self._special = dict(special_tokens)
    self.tokenizer, self.roles = tokenizer, tuple(roles_to_train)
    self.by_generation = (self.roles == ("assistant",)
                          and bool(_GENERATION_TAG.search(template)))

  def render(self, messages: list[dict], add_generation_prompt: bool = False
             ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its ``{% generation %}`` blocks."""
    blocks, spans = [], []
    self._env.tracking = (blocks, spans)
    try:
      for block in self._template.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **self._special):
        blocks.append(block)
    finally:
      self._env.tracking = None
    return "".join(blocks), spans

  def encode(self, conversations: Sequence[tuple[list[dict], str]]
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, targets) of each (messages, where) conversation, tokenized together."""
    import jinja2  # pylint: disable=import-outside-toplevel
    rendered = []
    for messages, where in conversations:
      try:
        text, spans = self.render(messages)
        if not self.by_generation:
          spans = self._turn_spans(messages, text, where)
      except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"{where}: the chat template fails on this conversation: {e}") from None
      rendered.append((text, spans))
    out = []
    encoded = self.tokenizer.encode_with_offsets([text for text, _ in rendered])
    for (messages, where), (_, spans), (ids, offsets) in zip(conversations, rendered, encoded):
      targets = _overlapping(offsets, spans)
      if not targets.any():
        how = ("no {% generation %} block" if self.by_generation
               else f"no turn of the roles {list(self.roles)} (DataConfig.roles_to_train)")
        raise ValueError(f"{where}: this conversation has no token to train: the template "
                         f"wrote {how} (roles: {[m.get('role') for m in messages]}); drop it "
                         "or give it a turn to train")
      out.append((ids, targets))
    return out

  def _turn_spans(self, messages, text, where) -> list[tuple[int, int]]:
    """The character span each trained turn adds to the rendering of the turns before it."""
    import jinja2  # pylint: disable=import-outside-toplevel
    fix = ("wrap the assistant turns in {% generation %}...{% endgeneration %} in the template "
           "(DataConfig.chat_template)")
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") not in self.roles:
        continue
      try:
        before = self._prefix(messages[:i])
        if message.get("role") == "assistant":
          header = self._prefix(messages[:i], add_generation_prompt=True)
          before = header if text.startswith(header) else before
        through = self.render(messages[:i + 1])[0]
      except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"{where}: labelling turn by turn renders the first turns alone, and "
                         f"the chat template fails on turns 0..{i} ({e}); {fix}") from None
      if not (text.startswith(through) and through.startswith(before)):
        raise ValueError(f"{where}: the chat template renders turn {i} differently once later "
                         f"turns follow, so the trained text cannot be found turn by turn; {fix}")
      spans.append((len(before), len(through)))
    return spans

  def _prefix(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The rendering of the turns before a trained one; of no turns (what a template writes
    before the first, e.g. BOS), "" where the template cannot render an empty conversation."""
    import jinja2  # pylint: disable=import-outside-toplevel
    try:
      return self.render(messages, add_generation_prompt)[0]
    except jinja2.exceptions.TemplateError:
      if messages:
        raise
      return ""


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
  """Whether each token's ``[start, end)`` character range overlaps one of ``spans`` (the rule
  of transformers' assistant mask)."""
  targets = np.zeros(len(offsets), bool)
  for a, b in spans:
    targets |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
  return targets


def messages_of(record: dict, where: str) -> list[dict]:
  """The messages of a ``messages`` or ShareGPT ``conversations`` record, checked; keys whose
  value is None are dropped (as transformers drops them; Parquet fills absent struct fields
  with None)."""
  sharegpt = "messages" not in record
  turns = record["conversations" if sharegpt else "messages"]
  field = "conversations" if sharegpt else "messages"
  if not isinstance(turns, list) or not turns:
    raise ValueError(f"{where}: {field!r} must be a non-empty list of turns, found "
                     f"{_describe(turns)}")
  messages = []
  for i, turn in enumerate(turns):
    if not isinstance(turn, dict):
      raise ValueError(f"{where}: {field}[{i}] must be an object, found {_describe(turn)}")
    turn = {k: v for k, v in turn.items() if v is not None}
    if sharegpt:
      speaker, value = turn.get("from"), turn.get("value")
      if speaker not in SHAREGPT_ROLES or not isinstance(value, str):
        raise ValueError(f"{where}: conversations[{i}] needs 'from' in {sorted(SHAREGPT_ROLES)} "
                         f"and a string 'value', found {_describe(turn)}")
      turn = {"role": SHAREGPT_ROLES[speaker], "content": value}
    elif not isinstance(turn.get("role"), str) or not isinstance(turn.get("content", ""),
                                                                  (str, list)):
      raise ValueError(f"{where}: messages[{i}] needs a string 'role' and a string (or list) "
                       f"'content', found {_describe(turn)}")
    messages.append(turn)
  return messages


def _describe(value) -> str:
  text = json.dumps(value, default=repr)
  return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
