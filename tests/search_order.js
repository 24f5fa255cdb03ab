// node tests/search_order.js SITE QUERY...: for each query, the pages the built site's search
// lists, best first, as JSON ({query: [page path, ...]}). It runs Material's own search
// worker (the site's assets/javascripts/workers/search.*.min.js, lunr inside) on the site's
// search index as the browser does, with the one option the page adds (search.suggest, off).
const fs = require("fs");
const path = require("path");
const vm = require("vm");

const [site, ...queries] = process.argv.slice(2);
const workers = path.join(site, "assets/javascripts/workers");
const worker = fs.readdirSync(workers).find((f) => /^search\..*\.min\.js$/.test(f));
let handler;
let answer;
const context = {
  console,
  addEventListener: (_, f) => { handler = f; },
  postMessage: (message) => { answer = message; },
  importScripts: () => {},  // (only for languages other than English)
};
context.self = context;
vm.createContext(context);
vm.runInContext(fs.readFileSync(path.join(workers, worker), "utf8"), context);

const SETUP = 0;
const QUERY = 2;
(async () => {
  const index = JSON.parse(fs.readFileSync(path.join(site, "search/search_index.json"), "utf8"));
  index.options = { suggest: false };
  await handler({ data: { type: SETUP, data: index } });
  const found = {};
  for (const query of queries) {
    await handler({ data: { type: QUERY, data: query } });
    found[query] = answer.data.items.map((group) => group[0].location.split("#")[0]);
  }
  console.log(JSON.stringify(found));
})();
