// Runs a wasm32-wasip1 program under Node's WASI, so under V8's wasm
// compilers (the runtime Envoy's wasm filters run in):
//   node wire/benches/wasi.mjs PROGRAM.wasm [ARGS...]
// The program sees ARGS and the environment; no directory is opened to it.
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import { argv, env, exit } from "node:process";

const wasi = new WASI({ version: "preview1", args: argv.slice(2), env, preopens: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(argv[2]));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance));
