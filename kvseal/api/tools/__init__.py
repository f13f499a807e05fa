"""Tool calling: one parser per chat-template family (hermes.py: Qwen2.5/Hermes `<tool_call>`, llama3.py: Llama 3.x
JSON calls), picked from the model's own template (families.py); what a request asks of them (plan.py).

A family turns generated text into Text and Call events (calls.py), incrementally, for whole answers and streams
alike: the same splitter runs on both, so a streamed answer and a whole one never disagree.
"""
