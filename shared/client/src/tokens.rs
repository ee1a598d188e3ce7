//! The client side of token management (`/api/v1/tokens`, instance admins only).

use reqwest::Method;

use crate::{Client, ClientError, CreatedToken, NewToken, TokenList, TokenView};
use takosumi_core::TokenId;

impl Client {
    /// `POST /api/v1/tokens` → the new token, its value shown this once.
    pub async fn create_token(&self, req: &NewToken) -> Result<CreatedToken, ClientError> {
        let path = "/api/v1/tokens";
        let rb = self.request(Method::POST, path).json(req);
        self.execute(Method::POST, path, rb).await
    }

    /// `GET /api/v1/tokens`: every token, newest first (never a value).
    pub async fn list_tokens(&self) -> Result<Vec<TokenView>, ClientError> {
        let path = "/api/v1/tokens";
        let list: TokenList = self
            .execute(Method::GET, path, self.request(Method::GET, path))
            .await?;
        Ok(list.tokens)
    }

    /// `DELETE /api/v1/tokens/{id}`: revoked from the next request on.
    pub async fn revoke_token(&self, id: TokenId) -> Result<TokenView, ClientError> {
        let path = format!("/api/v1/tokens/{id}");
        self.execute(Method::DELETE, &path, self.request(Method::DELETE, &path))
            .await
    }
}
