"""The chat page's routes in process: ``/`` and its files need no key and hold no data,
``/v1/status`` says what the status strip shows and needs the key like every API route.
(The page itself, in a browser: tests/browser.)"""

from __future__ import annotations

from trio_infer.api.routes import STATIC_DIR
from tests.api.helpers import chat_body, make_app, running

KEY = {"Authorization": "Bearer sekret"}


async def test_the_page_and_its_files_need_no_key_and_reveal_nothing(tokenizer) -> None:
    app = make_app(tokenizer, api_key="sekret", served_model_name="secret-model-name")
    async with running(app) as client:
        r = await client.get("/")
        assert r.status_code == 200
        assert r.content_type == "text/html; charset=utf-8"
        page = await r.get_data(as_text=True)
        assert page == (STATIC_DIR / "index.html").read_text()  # the file as shipped, nothing filled in
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        for name, kind in [("chat.js", "text/javascript"), ("style.css", "text/css")]:
            r = await client.get(f"/static/{name}")
            assert r.status_code == 200 and r.content_type.startswith(kind), name
            assert "secret-model-name" not in await r.get_data(as_text=True)
            assert f"/static/{name}" in page  # the page loads its files from here, nothing else
        # Nothing else is served without the key: not other files, not the API, not other methods.
        assert (await client.get("/static/missing.js")).status_code == 404
        for path in ["/static/..%2Froutes.py", "/static/../app.py", "/static/sub/chat.js"]:
            r = await client.get(path)  # no such route: not public, so the key is asked first
            assert r.status_code == 401, path
            assert "secret-model-name" not in await r.get_data(as_text=True)
        assert (await client.post("/")).status_code == 401
        for path in ["/v1/status", "/v1/models", "/metrics", "/index.html"]:
            r = await client.get(path)
            assert r.status_code == 401, path
            assert (await r.get_json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/status", headers=KEY)).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_status_reports_health_gauges_and_counters(tokenizer) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        before = await (await client.get("/v1/status")).get_json()
        assert before["healthy"] is True and before["problem"] is None
        assert before["model"] == "fake"
        assert before["requests"] == {"running": 0, "waiting": 0, "sessions": 0}
        assert before["kv_pages"]["used"] == 0 and before["kv_pages"]["total"] > 0
        assert before["tokens"] == {"prompt": 0, "generated": 0}
        r = await client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=5, ignore_eos=True))
        assert r.status_code == 200
        usage = (await r.get_json())["usage"]
        after = await (await client.get("/v1/status")).get_json()
        assert after["tokens"] == {"prompt": usage["prompt_tokens"], "generated": 5}
        assert after["requests"] == {"running": 0, "waiting": 0, "sessions": 0}
        assert after["time"] >= before["time"]
        # The finished request left no task behind (the test client runs in the app's trio run).
        assert after["tasks"] == before["tasks"] > 1
        # While the server drains, the page hears why it is unhealthy (from /health's logic).
        app.extensions["trio_infer"].engine.begin_drain()
        drained = await (await client.get("/v1/status")).get_json()
        assert drained["healthy"] is False and drained["problem"] == "the server is shutting down"
        assert (await client.get("/health")).status_code == 503
