from tests.helpers.qwen_server import qwen_server  # noqa: F401  # the shared Qwen servers of the agents' API tests
