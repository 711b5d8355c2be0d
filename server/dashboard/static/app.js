// The dashboard's shell: logging in with a tenant token, the hash routes, the navigation.
//
// Routes: #/studies, #/studies/ID[/progress|params|trials|arrays], #/cluster, #/login.
// `#token=...` logs in directly (what `fusetune demo` prints) and is removed from the address
// bar at once; the token lives in session storage only, and goes out as a bearer header.

import { auth, get, serverRoutes, setUnauthorizedHandler, ApiError } from "./api.js";
import { h, clear, announce } from "./util.js";
import { studiesView } from "./views/studies.js";
import { studyView } from "./views/study.js";
import { clusterView } from "./views/cluster.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
let current = null; // the mounted view: {dispose()}
let who = null;

function takeTokenFromUrl() {
  const m = location.hash.match(/(?:^#|[&#])token=([^&]+)/);
  if (!m) return;
  auth.set(decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search + "#/studies");
}

setUnauthorizedHandler(() => {
  auth.clear();
  who = null;
  if (!location.hash.startsWith("#/login")) location.hash = "#/login";
});

function mount(view) {
  current?.dispose?.();
  clear(main);
  current = view;
  if (view?.root) main.append(view.root);
  main.focus({ preventScroll: true });
}

function loginView(message) {
  const input = h("input#token", {
    type: "password", name: "token", autocomplete: "off", required: true, spellcheck: false,
    placeholder: "ft_…", "aria-describedby": "token-help",
  });
  const error = h("p.error", { role: "alert" }, message ?? "");
  const form = h("form.login", {
    onsubmit: async (e) => {
      e.preventDefault();
      const token = input.value.trim();
      if (!token) return;
      try {
        const me = await get("tenants", null, { token });
        auth.set(token);
        who = me;
        location.hash = "#/studies";
      } catch (err) {
        error.textContent = err instanceof ApiError && err.status === 401
          ? "That token is not valid (unknown or revoked)."
          : `Could not log in: ${err.message}`;
        input.focus();
      }
    },
  },
    h("h1", "fusetune"),
    h("p", "Log in with a tenant token."),
    h("label", { for: "token" }, "Token"),
    input,
    h("p.help#token-help", "A token of your tenant: ", h("code", "fusetune demo"),
      " prints one, and the admin issues more with ", h("code", "fusetune tenants token NAME"), ". ",
      "It is kept in this tab's session storage only."),
    h("button.primary", { type: "submit" }, "Log in"),
    error,
  );
  return { root: h("div.login-wrap", form), focus: () => input.focus() };
}

function renderNav(route) {
  clear(nav);
  if (!auth.token) return;
  const link = (href, label, active) =>
    h("a", { href, "aria-current": active ? "page" : null }, label);
  const tenant = who && who.length === 1 ? who[0].name : who ? "admin" : "";
  nav.append(
    h("a.brand", { href: "#/studies" }, "fusetune"),
    link("#/studies", "Studies", route[0] === "studies"),
    link("#/cluster", "Cluster", route[0] === "cluster"),
    h("span.spacer"),
    h("span.who", { "data-testid": "who" }, tenant ? `tenant: ${tenant}` : ""),
    h("span#stream-state.stream", { "aria-live": "polite" }),
    h("button.link", { type: "button", onclick: () => { auth.clear(); who = null; location.hash = "#/login"; } }, "Log out"),
  );
}

async function route() {
  takeTokenFromUrl();
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  if (!auth.token || parts[0] === "login") {
    if (auth.token && parts[0] === "login") { location.hash = "#/studies"; return; }
    renderNav([]);
    const view = loginView();
    mount(view);
    view.focus();
    document.title = "fusetune · log in";
    return;
  }
  await serverRoutes();
  if (!who) {
    try { who = await get("tenants"); } catch { who = null; if (!auth.token) return route(); }
  }
  renderNav(parts);
  if (parts[0] === "studies" && parts[1]) {
    mount(studyView(Number(parts[1]), parts[2] || "progress"));
  } else if (parts[0] === "cluster") {
    document.title = "fusetune · cluster";
    mount(clusterView());
  } else {
    if (parts[0] !== "studies") { history.replaceState(null, "", "#/studies"); }
    document.title = "fusetune · studies";
    mount(studiesView());
  }
  announce(document.title);
}

// A study view switches tabs itself (no remount), so only route changes that leave it remount.
window.addEventListener("hashchange", () => {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  if (current?.studyId && parts[0] === "studies" && Number(parts[1]) === current.studyId && auth.token) {
    current.showTab(parts[2] || "progress");
    return;
  }
  route();
});
route();
