"""The HTTP front: OpenAI's, Anthropic's and the Responses API's shapes, their routes, tool calls and error mapping.
It speaks to a Backend (router/backend.py) in the wire's messages (kvseal/wire) and never imports the engine."""
