#!/usr/bin/env python3
"""What one health probe costs a paused conversation on llama.cpp.

For each llama-server setting (host prompt cache on, the default, and
--cache-ram 0) and each probe kind (none; the chat "ping" Hearth used to
send; the fixed raw completion it sends now, once and three times), start
one llama-server with two slots, run the first turn of two conversations
(both slots full, both paused), send the probe, run both conversations'
second turns, and print how many prompt tokens each second turn read from
the engine's cache (usage.prompt_tokens_details.cached_tokens).

Needs scripts/setup (the llama-server and the model under .hearth/). Run
from the repository: python3 bench/probe-cost.py
"""
import json, os, subprocess, time, urllib.request, socket, random
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".hearth/bin/llama-server")
MODEL = os.path.join(ROOT, ".hearth/models/SmolLM2-135M-Instruct.Q4_1.gguf")
# The sidecar's probe prompt (ext-proc/src/probe.rs, PROBE_PROMPT).
PROBE = ("Hearth gateway health probe. This fixed text checks that the engine still "
         "generates tokens; it is not part of any conversation. Answer with one word:")
def port():
    s=socket.socket(); s.bind(("127.0.0.1",0)); p=s.getsockname()[1]; s.close(); return p
def post(base,path,body):
    r=urllib.request.Request(base+path,data=json.dumps(body).encode(),headers={"content-type":"application/json"})
    return json.load(urllib.request.urlopen(r,timeout=120))
def words(seed,n):
    rnd=random.Random(seed); W="alpha beta gamma delta router cache engine slot token prefix warm replica load queue file test build".split()
    return " ".join(rnd.choice(W) for _ in range(n))
def chat(base,conv,extra):
    conv["messages"].append({"role":"user","content":extra})
    r=post(base,"/v1/chat/completions",{"messages":conv["messages"],"max_tokens":4,"temperature":0})
    conv["messages"].append({"role":"assistant","content":r["choices"][0]["message"]["content"]})
    u=r.get("usage",{}); t=r.get("timings",{})
    return u.get("prompt_tokens"), (u.get("prompt_tokens_details") or {}).get("cached_tokens"), t.get("cache_n"), t.get("prompt_n")
def run(extra_args, probe):
    p=port(); base=f"http://127.0.0.1:{p}"
    proc=subprocess.Popen([BIN,"-m",MODEL,"--host","127.0.0.1","--port",str(p),"-np","2","-c","8192","-t","1"]+extra_args,stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
    # Ended below by its own handle (this script's child only).
    try:
        for _ in range(200):
            try:
                if urllib.request.urlopen(base+"/health",timeout=1).status==200: break
            except Exception: time.sleep(0.1)
        convs=[{"messages":[{"role":"system","content":"You are agent %d. "%i+words(i,400)}]} for i in range(2)]
        for c in convs: chat(base,c,words(100,150))
        if probe=="chat-ping":
            post(base,"/v1/chat/completions",{"messages":[{"role":"user","content":"ping"}],"max_tokens":1})
        elif probe=="raw":
            post(base,"/v1/completions",{"prompt":PROBE,"max_tokens":1,"temperature":0})
        elif probe=="raw-x3":
            for _ in range(3): post(base,"/v1/completions",{"prompt":PROBE,"max_tokens":1,"temperature":0})
        res=[chat(base,c,words(200+i,150)) for i,c in enumerate(convs)]
        return res
    finally:
        proc.kill(); proc.wait()
for args,label in [([],"default (cache-ram 8192)"),(["--cache-ram","0"],"--cache-ram 0")]:
    for probe in ["none","chat-ping","raw","raw-x3"]:
        res=run(args,probe)
        print(f"{label:26s} probe={probe:10s} " + "  ".join(f"conv{i}: prompt={r[0]} cached={r[1]} cache_n={r[2]}" for i,r in enumerate(res)), flush=True)
