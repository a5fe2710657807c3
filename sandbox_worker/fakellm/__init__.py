"""The scripted LLM provider: a real HTTP server speaking the OpenAI Responses,
OpenAI Chat Completions and Anthropic Messages wire formats, driven by a
script file. Used by tests, the benchmark and ``corral fake-llm``.

Modules: ``script`` (format and selection rule), ``wire`` (rendering per
provider), ``server`` (the HTTP server), ``launch`` (starting it as a child
process), ``__main__`` (``python -m sandbox_worker.fakellm``).

Exception tree::

    ScriptError (ValueError)     the script file is not a valid script
    FakeLLMStartError            the server process did not become ready
"""
