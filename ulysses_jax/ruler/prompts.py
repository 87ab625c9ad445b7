"""RULER's prompt templates, answer prefixes and generation budgets, and how a prompt is put
together around them.

The texts are those of NVIDIA/RULER's ``scripts/data/synthetic/constants.py`` (templates and
answer prefixes) and ``niah.py`` (the needle sentence, the singular rewrite); the budgets are its
``tokens_to_generate``. A prompt is ``wrap(task text) + answer prefix``: ``wrap`` is the
model's chat turn (RULER's ``model_template_type``; the identity for a base model), and the
answer prefix follows the turn, where the model's answer starts, as RULER's
``scripts/data/prepare.py`` writes it.
"""

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")

# family -> (template, answer prefix, tokens to generate)
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure "
        "to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided "
        "text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following "
        "text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} "
        "in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
        30),
    "common_words": (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the "
        "10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120),
    "frequent_words": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:",
        50),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not "
        "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer "
        "the question based on the given documents. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {query}",
        " Answer:",
        32),
}


def budget(family: str) -> int:
  """RULER's ``tokens_to_generate`` for a task family."""
  return TEMPLATES[family][2]


def singular(text: str) -> str:
  """RULER's rewrite of the NIAH template when one value is asked for (``niah.py``): "Some"
  -> "A", "are all" / "are" -> "is", "answers" -> "answer", applied to the template before it
  is filled in."""
  for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
    text = text.replace(plural, one)
  return text


def identity(text: str) -> str:
  """The wrap of a base model: the task text as it is (RULER's ``base`` template)."""
  return text


def chat_turn(template):
  """The wrap of a chat model: the task text as one user turn rendered by ``template`` (a
  ``chat.ChatTemplate``), the assistant's header after it (``add_generation_prompt=True``),
  as transformers' ``apply_chat_template`` renders it (RULER's ``model_template_type``)."""
  def wrap(text: str) -> str:
    import jinja2  # pylint: disable=import-outside-toplevel
    try:
      return template.render([{"role": "user", "content": text}],
                             add_generation_prompt=True)[0]
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"the chat template fails on a RULER prompt as a user turn: {e}; give "
                       "another with --chat_template or use --no_chat_template") from None
  return wrap


def assemble(wrap, user: str, prefix: str, shots=()) -> str:
  """The prompt's text: ``wrap(user) + prefix``, after the one-shot examples ``shots`` (each
  ``(user, answer)``, a whole turn with its prefix and answer, then a newline, as RULER's
  common-word task writes its example)."""
  examples = "".join(f"{wrap(u)}{prefix} {a}\n" for u, a in shots)
  return examples + wrap(user) + prefix
