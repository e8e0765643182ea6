"""HFTokenizer against transformers.AutoTokenizer on the same files (built here, no hub access):
a Qwen-style ChatML tokenizer (no BOS, pad != eos) and a Llama-3-style one (BOS from a
TemplateProcessing post-processor, template in chat_template.jinja, a list of eos ids)."""
import json

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxrl.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- endif %}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}{% generation %}{{- message.content }}{% endgeneration %}
    {%- else %}{{- message.content }}{%- endif %}
    {{- '<|im_end|>\\n' }}
    {%- if message.meta is defined %}{{- message.meta | tojson }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Year: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""

# Qwen3's shape: a reverse scan with a namespace, string methods, reasoning kept only after the
# last user query, tool turns merged, an `enable_thinking` switch.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# Gemma 3's, as transformers' Gemma 3 conversion script writes it: a system message becomes a
# prefix of the first user turn, the assistant is "model".
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Natalia sold clips to 48 of her friends.",
          "How many apples does she have left? #### 1,234", "def f(x):\n    return x * 2\n",
          "héllo wörld, naïve café", "数学很有趣。", "🙂 emoji 👍🏽 too", "1 + 1 = 2; 3/4 = 0.75"]

TEXTS = ["Hello world!", "  leading spaces and trailing  ", "line one\nline two\n\n\tindented",
         "héllo wörld 你好，世界 🙂👍🏽", "#### 1,234 and \\boxed{\\frac{1}{2}}", "",
         "special <|im_end|> token inside", "<tag> & \"quotes\" 'single'"]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse.  "}, {"role": "user", "content": "héllo 🙂\nline"}],
    [{"role": "system", "content": "You solve math."}, {"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2+2?"}],
    [{"role": "user", "content": "<b>bold</b> & json", "meta": {"k": "ü<>&"}, "name": None},
     {"role": "assistant", "content": "ok"}],
]


def _train(specials: list[str]) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([f"{line} {i}" for i in range(40) for line in CORPUS], trainer)
  return tok


def _write(directory, tok: Tokenizer, config: dict, **files) -> str:
  directory.mkdir()
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  for name, text in files.items():
    (directory / name.replace("__", ".")).write_text(text)
  return str(directory)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  tok = _train(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
            "eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False, "special": True,
                          "__type": "AddedToken"},
            "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE}
  return _write(tmp_path_factory.mktemp("qwen") / "tok", tok, config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  tok = _train(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"])
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                    pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                    special_tokens=[("<|begin_of_text|>", bos)])])
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>"}
  generation = {"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
  return _write(tmp_path_factory.mktemp("llama") / "tok", tok, config,
                chat_template__jinja=LLAMA_TEMPLATE,
                generation_config__json=json.dumps(generation))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, qwen_dir):
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>"}
  return _write(tmp_path_factory.mktemp("qwen3") / "tok",
                Tokenizer.from_file(f"{qwen_dir}/tokenizer.json"), config,
                chat_template__jinja=QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
  tok = _train(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
  bos = tok.token_to_id("<bos>")
  tok.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B:1",
                                    special_tokens=[("<bos>", bos)])])
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
            "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": GEMMA3_TEMPLATE}
  generation = {"eos_token_id": [tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")]}
  return _write(tmp_path_factory.mktemp("gemma3") / "tok", tok, config,
                generation_config__json=json.dumps(generation))


@pytest.fixture(params=["qwen", "llama", "qwen3", "gemma3"])
def pair(request, qwen_dir, llama_dir, qwen3_dir, gemma3_dir):
  directory = {"qwen": qwen_dir, "llama": llama_dir, "qwen3": qwen3_dir,
               "gemma3": gemma3_dir}[request.param]
  return HFTokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)


def test_special_ids_match(pair):
  ours, ref = pair
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
      ref.bos_token_id, ref.eos_token_id, ref.pad_token_id if ref.pad_token_id is not None
      else ref.eos_token_id)
  assert ours.vocab_size == len(ref)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match(pair, text):
  ours, ref = pair
  assert ours.encode(text, bos=True) == ref(text)["input_ids"]
  assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
  assert ours.encode_batch([text, "x"], bos=True)[0] == ref(text)["input_ids"]
  ids = ref(text.replace("<|im_end|>", ""))["input_ids"]
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
  assert ours.decode(np.asarray(ids)) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(pair, messages, add_generation_prompt):
  ours, ref = pair
  want = ref.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=add_generation_prompt)
  got = ours.chat(messages, add_generation_prompt=add_generation_prompt)
  assert got == want
  assert ours.encode(got) == ref.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


AGENTIC = [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>\nold thought\n</think>\n\na1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "calling", "reasoning_content": "\nplan\n"},
    {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
    {"role": "assistant", "content": "done", "thinking": "final thought"}]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen3_style_template_with_reasoning(qwen3_dir, kwargs):
  ours, ref = HFTokenizer.from_dir(qwen3_dir), transformers.AutoTokenizer.from_pretrained(qwen3_dir)
  for messages in (AGENTIC, AGENTIC[:4], CHATS[2]):
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.chat(messages, **kwargs) == want
  assert "<think>\nplan\n</think>" in ours.chat(AGENTIC)  # the reasoning after the last query
  assert "old thought" not in ours.chat(AGENTIC)


def test_template_raise_exception(qwen_dir):
  with pytest.raises(Exception, match="unknown role tool"):
    HFTokenizer.from_dir(qwen_dir).chat([{"role": "tool", "content": "x"}])


def test_stop_ids_and_decode_stops_at_eos(llama_dir, qwen_dir):
  llama = HFTokenizer.from_dir(llama_dir)
  eot = llama._tok.token_to_id("<|eot_id|>")
  assert llama.stop_ids == (llama.eos_id, eot)
  ids = llama.encode("fox", bos=True)
  assert llama.decode(ids + [eot] + llama.encode("junk")) == "fox"
  qwen = HFTokenizer.from_dir(qwen_dir)
  assert qwen.bos_id is None and qwen.stop_ids == (qwen.eos_id,) and qwen.pad_id != qwen.eos_id
  assert qwen.encode("fox", eos=True)[-1] == qwen.eos_id
  assert qwen.decode(qwen.encode("fox", eos=True) + [qwen.pad_id] * 3) == "fox"


def test_valid_mask_is_positional_when_pad_equals_eos(llama_dir):
  tok = HFTokenizer.from_dir(llama_dir)
  assert tok.pad_id == tok.eos_id  # no pad_token: falls back to eos
  seqs = [[5, tok.eos_id], [7]]
  tokens, valid = tok.pad_right(seqs, 3)
  np.testing.assert_array_equal(tokens, [[5, tok.eos_id, tok.pad_id], [7, tok.pad_id, tok.pad_id]])
  np.testing.assert_array_equal(valid, [[True, True, False], [True, False, False]])
  _, valid = tok.pad_left(seqs, 3)
  np.testing.assert_array_equal(valid, [[False, True, True], [False, False, True]])


def test_load_tokenizer_and_errors(tmp_path, qwen_dir):
  assert load_tokenizer("") == ByteTokenizer()
  assert isinstance(load_tokenizer(qwen_dir), HFTokenizer)
  with pytest.raises(TokenizerError, match=f"^{tmp_path}: no tokenizer.json"):
    load_tokenizer(str(tmp_path))
  with pytest.raises(TokenizerError, match="byte tokenizer has no chat template"):
    ByteTokenizer().chat([{"role": "user", "content": "x"}])
  bare = tmp_path / "bare"
  _write(bare, Tokenizer.from_file(f"{qwen_dir}/tokenizer.json"), {"eos_token": "<|im_end|>"})
  with pytest.raises(TokenizerError, match=r"bare: the tokenizer has no chat template"):
    load_tokenizer(str(bare)).chat([{"role": "user", "content": "x"}])


def test_missing_special_token_is_added_like_transformers(tmp_path, qwen_dir):
  directory = _write(tmp_path / "t", Tokenizer.from_file(f"{qwen_dir}/tokenizer.json"),
                     {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                      "pad_token": "<|pad|>"})
  ours, ref = HFTokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
  assert ours.pad_id == ref.pad_token_id and ours.vocab_size == len(ref)
  assert ours.encode("a <|pad|> b") == ref("a <|pad|> b", add_special_tokens=False)["input_ids"]

