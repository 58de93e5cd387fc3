"""ChatML pieces the offline tiny models' chat templates share (the character-level and the BPE
tokenizers' templates differ only in how they list the tools): the special tokens, and how the
messages render after the system block.

Without tools every message renders as <|im_start|>role\ncontent<|im_end|>\n; an assistant
message's `tool_calls` render as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> after
its content; consecutive `tool` messages render together as one user message of <tool_response>
blocks (the Hermes / Qwen2.5 format, which the `hermes` parser reads).
"""

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# the opening of the system block when there are tools (a system message's content first, then the
# tools, which each template lists its own way); ``ns.rest`` is the messages after it
TOOLS_SYSTEM_OPEN = (
    "{%- set ns = namespace(rest=messages) -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] + '\n\n' }}{%- set ns.rest = messages[1:] -%}"
    "{%- endif -%}"
)

# the messages after the system block (``ns.rest``), then the generation prompt
MESSAGES = (
    "{%- for message in ns.rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    # `'tool_calls' in message`, not `message.get(...)`: a method call goes through the sandbox's
    # checks, which made every message's render ~5x slower (the rollout renders each turn twice)
    "{%- if 'tool_calls' in message -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if 'function' in call else call -%}"
    "{%- if message['content'] or not loop.first -%}{{ '\n' }}{%- endif -%}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
