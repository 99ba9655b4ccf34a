"""The official OpenAI, Anthropic and Ollama Python clients, unchanged but for their HTTP transport, which
is pointed at the daemon's Unix socket. The test scripts beside this file import it."""
import anthropic
import httpx  # the ollama client's HTTP library
import ollama
import openai

try:  # the OpenAI client's: httpx2 in newer releases, httpx before
    import httpx2
except ImportError:
    httpx2 = httpx


def openai_client(socket):
    return openai.OpenAI(
        base_url="http://inferd/v1",
        api_key="not-needed",
        http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=socket)),
    )


def anthropic_client(socket):
    return anthropic.Anthropic(
        base_url="http://inferd",
        api_key="not-needed",
        http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=socket)),
    )


def ollama_client(socket):
    return ollama.Client(host="http://inferd", transport=httpx.HTTPTransport(uds=socket))
